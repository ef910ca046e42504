"""A chat body's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` as a :class:`ToolPlan`: what
the worker renders (the tools, on the wire), whether a call is forced (then through the grammar
engine: the response format becomes the JSON schema of the call), and what to parse the answer for.

``tool_choice``:

- ``"auto"`` (the default with tools): the model decides; its answer is parsed for calls
  (:mod:`producer.openai_compat.tool_calls`), else it is the content.
- ``"required"``, or ``{"type": "function", "function": {"name": ...}}``: a call is forced. Its JSON
  schema is ``{"name": <the function's name>, "arguments": <its parameters>}`` (one branch per allowed
  function); for ``required`` with ``parallel_tool_calls`` (the default) an array of one or more calls.
  vLLM forces a named ``tool_choice`` the same way.
- ``"none"``: as if the request had no tools: they are not rendered either (the model is not told of
  functions it may not call) and the answer is never parsed for calls.

Pure: no I/O; never imports torch, the engine, the worker or a web framework.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError

from tokenmill.producer.openai_compat.errors import BodyError
from tokenmill.protocol.schema import MAX_TOOLS, ToolSpec, describe_validation_error

ToolChoice = Literal["auto", "required", "function"]
_TOOLS = TypeAdapter(list[ToolSpec])
_DEFS_KEYS = ("$defs", "definitions")  # where a schema keeps the subschemas its "$ref"s name


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask of its answer.

    Attributes:
        tools: the function tools, validated as the wire carries them.
        choice: ``auto``, ``required`` or ``function`` (the one named in :attr:`function`).
        function: the function a named ``tool_choice`` forces.
        parallel: ``parallel_tool_calls``: whether a forced ``required`` answer may hold several calls.
    """

    tools: tuple[ToolSpec, ...]
    choice: ToolChoice = "auto"
    function: str | None = None
    parallel: bool = True

    @property
    def names(self) -> frozenset[str]:
        """The functions a call may name."""
        return frozenset(tool.function.name for tool in self.tools)

    @property
    def is_forced(self) -> bool:
        return self.choice != "auto"

    def wire_tools(self) -> list[dict[str, Any]]:
        """The tools as submit options (JSON-compatible, unset fields left out)."""
        return [tool.model_dump(mode="json", exclude_none=True) for tool in self.tools]

    def forced_format(self) -> dict[str, Any]:
        """The ``response_format`` that makes the model's answer the forced call(s)."""
        allowed = [tool for tool in self.tools if self.choice == "required" or tool.function.name == self.function]
        defs: dict[str, Any] = {}
        branches = [_call_schema(tool, defs) for tool in allowed]
        schema: dict[str, Any] = branches[0] if len(branches) == 1 else {"anyOf": branches}
        if self.choice == "required" and self.parallel:
            schema = {"type": "array", "items": schema, "minItems": 1}
        if defs:
            schema = {**schema, "$defs": defs}
        return {"type": "json_schema", "json_schema": {"name": "tool_calls", "schema": schema}}


def tool_plan(body: Mapping[str, Any]) -> ToolPlan | None:
    """The plan of a chat body, or None when it asks for no tools (none given, or ``tool_choice: "none"``).

    Raises:
        BodyError: malformed tools, a ``tool_choice`` naming no given function, or a forced call
            together with a ``response_format`` (the call's schema is the format).
    """
    for name in ("functions", "function_call"):
        if body.get(name) is not None:
            raise BodyError(name, "the deprecated function-calling fields are not supported: send tools and "
                                  "tool_choice")
    tools, choice = _tools(body.get("tools")), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BodyError("parallel_tool_calls", "must be a boolean")
    if choice in (None, "auto", "none"):
        return ToolPlan(tuple(tools), parallel=parallel is not False) if tools and choice != "none" else None
    if not tools:
        raise BodyError("tool_choice", "a tool call is asked for but no tools are given")
    if choice == "required":
        plan = ToolPlan(tuple(tools), "required", parallel=parallel is not False)
    else:
        plan = ToolPlan(tuple(tools), "function", _named_function(choice, tools), parallel=parallel is not False)
    if body.get("response_format") not in (None, {"type": "text"}):
        raise BodyError("response_format", "cannot be combined with a forced tool_choice: the call's schema is the "
                                           "format")
    return plan


def _tools(value: Any) -> list[ToolSpec]:
    if value is None or value == []:
        return []
    if not isinstance(value, list):
        raise BodyError("tools", "must be a list of function tools")
    if len(value) > MAX_TOOLS:
        raise BodyError("tools", f"at most {MAX_TOOLS} tools")
    for index, tool in enumerate(value):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise BodyError(f"tools[{index}]", 'only function tools ({"type": "function", ...}) are supported')
    try:
        tools = _TOOLS.validate_python([_without_nulls(tool) for tool in value])
    except ValidationError as exc:
        raise BodyError("tools", describe_validation_error(exc)) from None
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise BodyError("tools", "function names must be unique")
    return tools


def _without_nulls(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A tool without its null fields (clients send ``"strict": null``, meaning unset)."""
    function = tool.get("function")
    if isinstance(function, Mapping):
        function = {key: value for key, value in function.items() if value is not None}
    return {**{key: value for key, value in tool.items() if value is not None}, "function": function}


def _named_function(choice: Any, tools: list[ToolSpec]) -> str:
    function = choice.get("function") if isinstance(choice, Mapping) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str):
        raise BodyError("tool_choice", 'must be "none", "auto", "required" or '
                                       '{"type": "function", "function": {"name": ...}}')
    if name not in {tool.function.name for tool in tools}:
        raise BodyError("tool_choice", f"names function {name!r}, which is not among the tools")
    return name


def _call_schema(tool: ToolSpec, defs: dict[str, Any]) -> dict[str, Any]:
    """``{"name": <the name>, "arguments": <its parameters>}`` as a JSON schema; the parameters'
    subschemas (``$defs``) move to the root, ``defs``, under the function's name, since their
    ``$ref``s point from the root."""
    name = tool.function.name
    parameters = dict(tool.function.parameters or {"type": "object", "properties": {}})
    for key in _DEFS_KEYS:
        for def_name, subschema in (parameters.pop(key, None) or {}).items():
            defs[f"{name}.{def_name}"] = _relocated(subschema, name)
    return {"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                             "arguments": _relocated(parameters, name)},
            "required": ["name", "arguments"]}


def _relocated(schema: Any, name: str) -> Any:
    """``schema`` with its ``$ref``s to ``#/$defs/X`` (or ``#/definitions/X``) pointing at
    ``#/$defs/<name>.X``."""
    if isinstance(schema, list):
        return [_relocated(item, name) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {key: _relocated(value, name) for key, value in schema.items()}
    ref = schema.get("$ref")
    for key in _DEFS_KEYS:
        if isinstance(ref, str) and ref.startswith(f"#/{key}/"):
            out["$ref"] = f"#/$defs/{name}.{ref[len(key) + 3:]}"
    return out
