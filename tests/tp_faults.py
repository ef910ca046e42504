"""A fault injected into a tensor-parallel rank's forward, for tests (never imported by the engine).

``install(token, layer)`` makes every Llama forward whose inputs hold ``token`` at position 0 (a prompt's first
token: no generated token sits there) raise in decoder layer ``layer``, after the layers before it made their
all-reduces: a failure in the middle of a step. Rank 0 (the test's process) installs it with pytest's
monkeypatch; a follower rank installs it as it starts when :data:`FAULT_ENV` says ``TOKEN:LAYER``, through
``tests/tp_fault_site/sitecustomize.py`` (a test puts that folder on the followers' ``PYTHONPATH``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

FAULT_ENV = "TOKENMILL_TEST_TP_FAULT"
SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tp_fault_site")


class InjectedFault(RuntimeError):
    """The injected failure."""


def install(token: int, layer: int, set_attribute: Callable[[Any, str, Any], None] = setattr) -> None:
    """Patch Llama's model and decoder-layer forwards (``set_attribute``: pytest's ``monkeypatch.setattr`` to undo
    it after a test)."""
    from transformers.models.llama import modeling_llama

    model_forward = modeling_llama.LlamaModel.forward
    layer_forward = modeling_llama.LlamaDecoderLayer.forward
    poisoned = [False]

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        ids, positions = kwargs.get("input_ids"), kwargs.get("position_ids")
        poisoned[0] = ids is not None and positions is not None and bool(((ids == token) & (positions == 0)).any())
        return model_forward(self, *args, **kwargs)

    def layer_forward_or_fail(self: Any, *args: Any, **kwargs: Any) -> Any:
        if poisoned[0] and self.self_attn.layer_idx == layer:
            raise InjectedFault(f"injected fault in layer {layer} (pid {os.getpid()})")
        return layer_forward(self, *args, **kwargs)

    set_attribute(modeling_llama.LlamaModel, "forward", forward)
    set_attribute(modeling_llama.LlamaDecoderLayer, "forward", layer_forward_or_fail)


def install_from_env() -> None:
    """In a follower rank: :func:`install` as :data:`FAULT_ENV` asks (nothing when it is unset)."""
    spec = os.environ.get(FAULT_ENV)
    if spec:
        token, layer = (int(part) for part in spec.split(":"))
        install(token, layer)
