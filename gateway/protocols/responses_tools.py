"""Tools of the OpenAI Responses API (``tools``, ``tool_choice``) and what the model is
offered of them.

- ``function``: a function (``strict`` defaults to true, as on OpenAI's API);
- ``namespace``: a group of functions, each offered as ``<namespace>__<name>`` and
  answered as a ``function_call`` carrying the ``namespace``, as OpenAI answers;
- ``custom``: free-form input (Codex's ``apply_patch``), held to its Lark or regex
  ``format`` (:mod:`gateway.conversation.call_grammar`), answered as a ``custom_tool_call``;
- ``local_shell``: a command the client runs, answered as a ``local_shell_call``;
- any other type is a hosted tool OpenAI runs itself (``web_search``, ``file_search``,
  ``code_interpreter``, ``image_generation``, ``computer_use_preview``, remote ``mcp``):
  the gateway runs none, so they are left out of the prompt and named in the response's
  :data:`gateway.conversation.tools.OMITTED_TOOLS_HEADER`; a ``tool_choice`` forcing one
  is a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Discriminator, Field, StrictBool, StrictStr, Tag, model_validator

from gateway.conversation.form import FunctionTool
from gateway.conversation.tools import namespaced
from gateway.http.errors import APIError
from gateway.protocols.openai_schemas import TOOL_NAME, Strict

# The action of a local_shell call, as OpenAI's local_shell_call items carry it.
LOCAL_SHELL_PARAMETERS = {
    "type": "object",
    "properties": {"command": {"type": "array", "items": {"type": "string"}},
                   "working_directory": {"type": "string"}, "timeout_ms": {"type": "integer"},
                   "env": {"type": "object", "additionalProperties": {"type": "string"}}},
    "required": ["command"],
}
LOCAL_SHELL_DESCRIPTION = "Runs a command on the user's machine and returns its output."


class FunctionToolParam(Strict):
    """A function the model may call (flat, unlike chat completions' ``function`` object).
    ``strict`` defaults to true, as on OpenAI's Responses API."""

    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = Field(default=None, description="a JSON Schema of the arguments object")
    strict: Optional[StrictBool] = None


class NamespaceToolParam(Strict):
    """A group of function tools (``namespace``): the model calls each as a function,
    answered as a ``function_call`` with the ``namespace``."""

    type: Literal["namespace"]
    name: str = Field(pattern=TOOL_NAME)
    description: Optional[str] = None
    tools: list[FunctionToolParam] = Field(default_factory=list)


class GrammarFormat(Strict):
    """A custom tool's input ``format``: free ``text``, or a ``grammar`` (``syntax``
    ``lark`` or ``regex``, and its ``definition``)."""

    type: Literal["text", "grammar"]
    syntax: Optional[Literal["lark", "regex"]] = None
    definition: Optional[StrictStr] = None

    @model_validator(mode="after")
    def _grammar(self):
        if self.type == "grammar" and (self.syntax is None or self.definition is None):
            raise ValueError("a grammar format needs a syntax and a definition")
        return self


class CustomToolParam(Strict):
    """A tool whose input is free-form text (``custom``), held to its ``format``."""

    type: Literal["custom"]
    name: str = Field(pattern=TOOL_NAME)
    description: Optional[str] = None
    format: Optional[GrammarFormat] = None


class LocalShellToolParam(Strict):
    """``local_shell``: the client runs the commands the model asks for."""

    type: Literal["local_shell"]


class HostedToolParam(Strict):
    """A tool OpenAI runs itself (``web_search``, ``file_search``, ``code_interpreter``,
    ``image_generation``, ``computer_use_preview``, remote ``mcp``, ...): accepted, not run."""

    type: StrictStr
    name: Optional[str] = None
    server_label: Optional[str] = None

    @property
    def label(self) -> str:
        """How the response header names it: its type, and its name or MCP server label."""
        extra = self.name or self.server_label
        return f"{self.type}:{extra}" if extra else self.type


_TOOL_KINDS = ("function", "namespace", "custom", "local_shell")


def _tool_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in _TOOL_KINDS else "hosted"


ToolParam = Annotated[
    Union[Annotated[FunctionToolParam, Tag("function")], Annotated[NamespaceToolParam, Tag("namespace")],
          Annotated[CustomToolParam, Tag("custom")], Annotated[LocalShellToolParam, Tag("local_shell")],
          Annotated[HostedToolParam, Tag("hosted")]],
    Discriminator(_tool_kind),
]


class NamedFunction(Strict):
    """``tool_choice`` naming one function (of a ``namespace``, when given) or ``custom``
    tool the model must call."""

    type: Literal["function", "custom"]
    name: StrictStr
    namespace: Optional[StrictStr] = None


class AllowedTools(Strict):
    """``tool_choice`` ``allowed_tools``: ``mode`` ``auto`` or ``required``, calls held to
    the ``tools`` it lists (each ``{"type", "name"}``, ``namespace`` for a namespace's
    function); the prompt still shows every tool, so it stays cacheable."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)


class HostedChoice(Strict):
    """``tool_choice`` forcing a hosted tool (``{"type": "web_search"}``, ...), which the
    gateway cannot run."""

    type: StrictStr


def offered_tools(tools: list) -> tuple[list[FunctionTool], list[str]]:
    """The tools the model is offered (namespace tools' functions one by one), and the
    hosted tools left out (:meth:`HostedToolParam.label`)."""
    out, omitted = [], []
    for i, t in enumerate(tools):
        if isinstance(t, FunctionToolParam):
            out.append(_function(t, f"tools.{i}"))
        elif isinstance(t, NamespaceToolParam):
            out += [_function(f, f"tools.{i}.tools.{j}", t.name) for j, f in enumerate(t.tools)]
        elif isinstance(t, CustomToolParam):
            grammar = (t.format.syntax, t.format.definition) if t.format is not None and t.format.type == "grammar" \
                else None
            out.append(FunctionTool(t.name, t.description, None, f"tools.{i}", kind="custom", grammar=grammar))
        elif isinstance(t, LocalShellToolParam):
            out.append(FunctionTool("local_shell", LOCAL_SHELL_DESCRIPTION, LOCAL_SHELL_PARAMETERS, f"tools.{i}",
                                    kind="local_shell"))
        else:
            omitted.append(t.label)
    return out, omitted


def _function(t: FunctionToolParam, param: str, namespace: Optional[str] = None) -> FunctionTool:
    return FunctionTool(t.name, t.description, t.parameters, param, "parameters", strict=t.strict is not False,
                        namespace=namespace)


def tool_choice(choice) -> tuple[str, Optional[str], Optional[list[str]]]:
    """``tool_choice`` as the internal choice, the offered name it forces (if any) and the
    offered names ``allowed_tools`` allows (None: all).

    Raises:
        APIError: 400 for a choice that forces a hosted tool, or names no tool.
    """
    if choice is None:
        return "auto", None, None
    if isinstance(choice, str):
        return choice, None, None
    if isinstance(choice, AllowedTools):
        names = [namespaced(t.get("namespace"), t["name"]) if "name" in t else
                 "local_shell" if t.get("type") == "local_shell" else None for t in choice.tools]
        return choice.mode, None, [n for n in names if n]
    if isinstance(choice, NamedFunction):
        return "function", namespaced(choice.namespace, choice.name), None
    if choice.type == "local_shell":
        return "function", "local_shell", None
    if choice.type in ("function", "custom"):
        raise APIError(400, f"a tool_choice of type '{choice.type}' needs the tool's name", param="tool_choice.name")
    raise APIError(400, f"tool_choice forces the hosted tool '{choice.type}', which this gateway does not run",
                   param="tool_choice.type")
