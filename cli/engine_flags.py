"""vLLM's engine flags under vLLM's names (``--dtype``, ``--max-model-len``, ``-tp``, ...), for ``tokenmill
worker`` and for ``serve`` / ``bulk`` with ``--model`` (their in-process worker).

:data:`FLAGS` is the one table that maps each flag to the setting it sets (a dotted path in the worker's
settings, as in the TOML file); :func:`with_engine_flags` adds every flag of the table to a command, and
:class:`EngineFlags` turns what was given into settings overrides (flags > env > file > defaults, as every
other flag). Imports no worker, no engine, no torch: ``--help`` stays light.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer
from pydantic import ValidationError

from tokenmill.cli.common import fail, validation_exit
from tokenmill.protocol.errors import ProducerError

if TYPE_CHECKING:
    from tokenmill.worker.config import Settings

PANEL = "Engine (vLLM's flags)"
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32", "float64")
_DTYPE_NAMES = {"half": "float16", "float": "float32"}  # vLLM's short names -> the engine's
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_token_count(value: str) -> int:
    """A token count as vLLM reads ``--max-model-len``: ``4096``, ``4k`` (4,000), ``4K`` (4,096), ``25.6k``."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgKMG]?)\s*", value)
    if not match:
        raise ValueError(f"not a token count: {value!r} (e.g. 4096, 4k = 4000, 4K = 4096)")
    return int(float(match.group(1)) * _COUNT_UNITS[match.group(2)])


def parse_gib_or_size(value: str) -> str:
    """``--swap-space``: a plain number is GiB as in vLLM (``4`` -> ``4GiB``); a size with a unit passes as is."""
    return f"{value.strip()}GiB" if re.fullmatch(r"\s*[0-9]*\.?[0-9]+\s*", value) else value


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class EngineFlag:
    """One vLLM flag: its names, the setting it sets and how a given value becomes the setting's value."""

    names: tuple[str, ...]  # the first is vLLM's; a boolean flag's is "--on/--off"
    setting: str  # dotted path in the worker's settings (the TOML file's section and key)
    kind: Any  # the option's type (typer's annotation): int, float, bool, str or a Literal of choices
    help: str
    convert: Callable[[Any], Any] = _same  # given value -> setting value
    parser: Callable[[str], Any] | None = None  # parse-time check and conversion (an error names the flag)
    metavar: str | None = None

    @property
    def flag(self) -> str:
        """The flag's name as typed (``--enable-prefix-caching``)."""
        return self.names[0].split("/")[0]

    @property
    def param(self) -> str:
        """The command parameter's name (``enable_prefix_caching``)."""
        return self.flag.lstrip("-").replace("-", "_")

    def option(self) -> Any:
        """The typer annotation of the flag's parameter (default None: not given, the settings decide)."""
        return Annotated[self.kind | None, typer.Option(
            *self.names, help=f"{self.help} ({self.setting})", rich_help_panel=PANEL, parser=self.parser,
            metavar=self.metavar, show_default=False)]


# NOTE: the one table from vLLM's flags to tokenmill's settings; docs/operations.md ("vLLM's flags") lists it too
# (tests/unit/test_cli_engine_flags.py checks that every flag here is there and sets its setting).
FLAGS: tuple[EngineFlag, ...] = (
    EngineFlag(("--device",), "engine.model.device", Literal["auto", "cpu", "cuda"], "auto, cpu or cuda"),
    EngineFlag(("--dtype",), "engine.model.dtype", Literal[DTYPES],
               "auto (float32 on CPU, bfloat16 on CUDA), float16 (half), bfloat16, float32 (float) or float64",
               convert=lambda value: _DTYPE_NAMES.get(value, value), metavar="DTYPE"),
    EngineFlag(("--served-model-name",), "worker.served_model_name", str,
               "the model name requests and /v1/models use (default: the alias or the model directory's name)"),
    EngineFlag(("--max-model-len",), "engine.model.max_model_len", int,
               "most prompt + output tokens of a request (4096, 4k = 4000, 4K = 4096; default: the model's)",
               parser=parse_token_count, metavar="TOKENS"),
    EngineFlag(("--tensor-parallel-size", "-tp"), "engine.model.tensor_parallel_size", int,
               "processes (CUDA: GPUs) the model is sharded over"),
    EngineFlag(("--max-num-seqs",), "engine.scheduler.max_num_seqs", int, "requests running at once"),
    EngineFlag(("--max-num-batched-tokens",), "engine.scheduler.max_num_batched_tokens", int,
               "tokens per step, prefill and decode together (at least max_prefill_chunk, default 512)"),
    EngineFlag(("--gpu-memory-utilization",), "engine.cache.gpu_memory_utilization", float,
               "CUDA: fraction of the GPU's total memory for the weights, the KV cache and the steps' activations, "
               "as in vLLM"),
    EngineFlag(("--kv-cache-memory", "--kv-cache-memory-bytes"), "engine.cache.kv_cache_memory", str,
               "KV cache size, bytes or e.g. 4GiB (default: 1GiB on CPU, --gpu-memory-utilization on CUDA)",
               metavar="SIZE"),
    EngineFlag(("--swap-space",), "engine.cache.swap_space", str,
               "host memory for swapped-out requests' KV: GiB as in vLLM (4) or a size (512MiB)",
               parser=parse_gib_or_size, metavar="GIB"),
    EngineFlag(("--block-size",), "engine.cache.block_size", int, "tokens per KV cache block"),
    EngineFlag(("--enable-prefix-caching/--no-enable-prefix-caching",), "engine.cache.enable_prefix_caching", bool,
               "reuse the KV of prompt prefixes computed before (default on)"),
    EngineFlag(("--enforce-eager/--no-enforce-eager",), "engine.execution.decode_fast_path", bool,
               "eager steps: no CUDA graphs, no captured CPU layers (decode_fast_path = off)",
               convert=lambda value: "off" if value else "auto"),
)
NOT_TAKEN = {  # vLLM flags users type that have no setting here, and why (docs/operations.md lists them)
    "--seed": "the engine has no process-wide seed: give each request its seed (tokenmill bulk --seed: every row's)",
}


@dataclass(frozen=True)
class EngineFlags:
    """The engine flags a command was given (parameter name -> value; None: not given)."""

    values: Mapping[str, Any]

    @property
    def given(self) -> list[str]:
        """The flags given, as typed (``--dtype``), in the table's order."""
        return [flag.flag for flag in FLAGS if self.values.get(flag.param) is not None]

    def overrides(self) -> dict[str, Any]:
        """The settings the given flags set, nested as the TOML file (``{"engine": {"model": {"dtype": ...}}}``)."""
        nested: dict[str, Any] = {}
        for flag in FLAGS:
            value = self.values.get(flag.param)
            if value is None:
                continue
            *sections, key = flag.setting.split(".")
            section = nested
            for name in sections:
                section = section.setdefault(name, {})
            section[key] = flag.convert(value)
        return nested


NO_FLAGS = EngineFlags({})  # a command's default: typer passes what was given (see with_engine_flags)


def setting_flags() -> dict[str, str]:
    """Each setting's dotted path -> the flag that sets it (error messages name the flag beside the setting)."""
    return {flag.setting: flag.flag for flag in FLAGS}


def load_worker_settings(config_file: Path | None, overrides: Mapping[str, Any]) -> Settings:
    """The worker's settings (flags > env > file > defaults); exit 1 naming every invalid value, with the flag
    that set it (``engine.model.dtype (--dtype)``) and the nearest key of an unknown one."""
    from tokenmill.worker.config import Settings  # noqa: PLC0415 - pydantic only, but not for --help

    try:
        return Settings.load(config_file, overrides)
    except ProducerError as exc:  # NOTE: an unreadable settings file
        raise fail(f"error: {exc}") from None
    except ValidationError as exc:
        raise validation_exit(exc, model=Settings, flags=setting_flags()) from None


def merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` on top, section by section (a None in ``extra`` leaves ``base``'s value)."""
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge(merged[key], value)
        elif value is not None or key not in merged:
            merged[key] = value
    return merged


def with_engine_flags(command: Callable[..., None]) -> Callable[..., None]:
    """Give ``command`` every flag of :data:`FLAGS` (shown in ``--help`` under :data:`PANEL`); it receives
    them as one keyword argument, ``engine_flags: EngineFlags``, in place of its own parameter of that name."""
    signature = inspect.signature(command, eval_str=True)
    own = [param for name, param in signature.parameters.items() if name != "engine_flags"]
    clashes = {flag.param for flag in FLAGS} & {param.name for param in own}
    assert not clashes and "engine_flags" in signature.parameters, f"{command.__name__}: {clashes or 'engine_flags?'}"
    added = [inspect.Parameter(flag.param, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=flag.option())
             for flag in FLAGS]

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        values = {flag.param: kwargs.pop(flag.param, None) for flag in FLAGS}
        command(*args, engine_flags=EngineFlags(values), **kwargs)

    # NOTE: typer reads the parameters from the signature: the command's own, then the table's
    wrapper.__signature__ = signature.replace(parameters=[*own, *added])  # type: ignore[attr-defined]
    return wrapper
