"""A step's integer inputs packed into one tensor and uploaded in one copy (engine/model/step_inputs.py)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.model.step_inputs import StepInputs, TableRows

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
def test_every_list_comes_back_as_a_view_of_one_upload(device: str) -> None:
    inputs = StepInputs()
    inputs.add("ids", [5, 6, 7])
    inputs.add("empty", [])
    inputs.add("slots", [2**40, 0])
    uploaded = inputs.upload(torch.device(device))
    assert {name: t.tolist() for name, t in uploaded.items()} == {"ids": [5, 6, 7], "empty": [], "slots": [2**40, 0]}
    assert all(t.dtype == torch.int64 and t.device.type == device for t in uploaded.values())
    storages = {t.untyped_storage().data_ptr() for t in uploaded.values()}
    assert len(storages) == 1  # one tensor: one host-to-device copy


@pytest.mark.parametrize("device", DEVICES)
def test_rows_of_a_host_table_are_gathered_into_the_same_upload(device: str) -> None:
    """The persistent batch's block tables (engine/model/input_batch.py): gathered into the packed (pinned, on CUDA)
    tensor with the lists around them, and uploaded in the same copy."""
    table = torch.arange(48, dtype=torch.int64).view(6, 8)
    inputs = StepInputs()
    inputs.add("ids", [5, 6, 7])
    inputs.add_rows("tables", TableRows(table, [4, 1, 4], 3))
    inputs.add("seq_lens", [2**40])
    uploaded = inputs.upload(torch.device(device))
    assert {name: t.tolist() for name, t in uploaded.items()} == {
        "ids": [5, 6, 7], "tables": [32, 33, 34, 8, 9, 10, 32, 33, 34], "seq_lens": [2**40]}
    assert len({t.untyped_storage().data_ptr() for t in uploaded.values()}) == 1
    assert inputs.host().is_pinned() == (device == "cuda")
