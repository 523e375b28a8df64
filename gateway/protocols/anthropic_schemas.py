"""Request schemas for Anthropic's Messages API (``POST /v1/messages`` and
``POST /v1/messages/count_tokens``), pydantic v2.

Types are strict (``"max_tokens": "32"`` or ``"stream": "yes"`` is a 400, as on
Anthropic's API); unknown fields are accepted and ignored (``citations``,
``service_tier``, ``container``, ...). Every block and tool type the API defines is
accepted: what the gateway cannot use is left out of the prompt in the nearest form
(see ``anthropic.py``); images reach vision models (a text model refuses them with a 400
naming the field), documents are refused. Recent SDKs take ``temperature``/``top_p``/``top_k``
and the gateway's extra sampling settings (``min_p``, ``seed``, penalties,
``logit_bias``) through ``extra_body``: they are plain body fields here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator, \
    model_validator
from pydantic_core import PydanticCustomError

from gateway.protocols.openai_schemas import MAX_STOP_SEQUENCES, SamplingExtras, data_path, validate

TOOL_NAME = r"^[a-zA-Z0-9_-]{1,128}$"  # Anthropic's rule for tool names


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


# ---------------------------------------------------------------------- content blocks
class CacheControl(_Strict):
    """``cache_control``: the prompt up to the end of this block is cached (snapshotted at
    that token boundary) and kept for ``ttl`` (``5m``, the default, or ``1h``)."""

    type: Literal["ephemeral"]
    ttl: Optional[Literal["5m", "1h"]] = None

    @property
    def seconds(self) -> float:
        return 3600.0 if self.ttl == "1h" else 300.0


class TextBlock(_Strict):
    type: Literal["text"]
    text: StrictStr
    cache_control: Optional[CacheControl] = None


class ToolUseBlock(_Strict):
    """An earlier call of the assistant; ``input`` is its arguments object."""

    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any]
    cache_control: Optional[CacheControl] = None


class ToolReferenceBlock(_Strict):
    """A deferred tool loaded by a tool search (Anthropic's tool search: a tool result
    that names a tool whose definition was sent with ``defer_loading``)."""

    type: Literal["tool_reference"]
    tool_name: StrictStr


class MediaBlock(_Strict):
    """An image or a document: parsed so that the answer can say the model takes none."""

    type: Literal["image", "document"]
    source: Optional[dict[str, Any]] = None
    cache_control: Optional[CacheControl] = None


class SearchResultBlock(_Strict):
    """A search result given to the model (``search_result``): its title, source and text."""

    type: Literal["search_result"]
    source: StrictStr = ""
    title: StrictStr = ""
    content: list[TextBlock] = Field(default_factory=list)
    cache_control: Optional[CacheControl] = None

    def text(self) -> str:
        return "\n".join(p for p in (self.title, self.source, "".join(b.text for b in self.content)) if p)


ResultPart = Annotated[Union[TextBlock, ToolReferenceBlock, MediaBlock, SearchResultBlock],
                       Field(discriminator="type")]


class ToolResultBlock(_Strict):
    """The result of call ``tool_use_id``: text, search results, tools it loaded
    (``tool_reference``), images."""

    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: Union[StrictStr, list[ResultPart]] = ""
    is_error: Optional[StrictBool] = None
    cache_control: Optional[CacheControl] = None


class ThinkingBlock(_Strict):
    """Earlier reasoning of the assistant (its ``signature`` is not checked)."""

    type: Literal["thinking"]
    thinking: StrictStr
    signature: Optional[StrictStr] = None


class RedactedThinkingBlock(_Strict):
    """Encrypted reasoning from Anthropic's models: accepted and dropped."""

    type: Literal["redacted_thinking"]
    data: Optional[StrictStr] = None


class ServerToolUseBlock(_Strict):
    """A call of a tool the API runs itself (``server_tool_use``, ``mcp_tool_use``), in an
    earlier answer of Anthropic's: shown to the model as the call it was."""

    type: Literal["server_tool_use", "mcp_tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any] = Field(default_factory=dict)
    cache_control: Optional[CacheControl] = None


# The results of the API's own tools, as earlier answers carry them.
SERVER_RESULTS = ("web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result",
                  "bash_code_execution_tool_result", "text_editor_code_execution_tool_result",
                  "tool_search_tool_result", "mcp_tool_result")


class ServerToolResultBlock(_Strict):
    """The result of a server tool's call (``web_search_tool_result``, ...): shown to the
    model as a tool result (its content as JSON)."""

    type: Literal[SERVER_RESULTS]
    tool_use_id: StrictStr
    content: Any = None
    cache_control: Optional[CacheControl] = None


class DroppedBlock(_Strict):
    """Blocks that carry nothing a prompt can show (``container_upload``): accepted, left out."""

    type: Literal["container_upload"]


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock, MediaBlock,
                        SearchResultBlock, ServerToolUseBlock, ServerToolResultBlock, DroppedBlock],
                  Field(discriminator="type")]


class MessageParam(_Strict):
    """One message: ``content`` is a string or a list of blocks. A ``system`` message
    (Claude Code sends one inside ``messages``) is rendered where it stands."""

    role: Literal["user", "assistant", "system"]
    content: Union[StrictStr, list[Block]]


# ---------------------------------------------------------------------- tools
class Tool(_Strict):
    """A tool: a client tool (``type`` ``custom`` or absent, with its ``input_schema``),
    one of Anthropic's client tools whose schema the API knows (``bash_20250124``,
    ``text_editor_...``, ``memory_...``, ``computer_...``), or a tool the API runs itself
    (``web_search_...``, ``tool_search_tool_regex_...``, ...). ``defer_loading``: left out
    of the prompt until a tool search loads it."""

    type: Optional[StrictStr] = None
    name: str = Field(pattern=TOOL_NAME)
    description: Optional[StrictStr] = None
    input_schema: Optional[dict[str, Any]] = Field(default=None, validate_default=True,
                                                   description="a JSON Schema of the tool's input object")
    cache_control: Optional[CacheControl] = None
    defer_loading: Optional[StrictBool] = None
    strict: Optional[StrictBool] = None

    @field_validator("input_schema")
    @classmethod
    def _schema(cls, v, info):
        if v is None and info.data.get("type") in (None, "custom"):
            raise PydanticCustomError("missing", "a custom tool needs an input_schema")
        return v


class ToolChoice(_Strict):
    """``tool_choice``: ``auto``, ``any`` (some tool must be called), ``tool`` (``name``
    must be called) or ``none``."""

    type: Literal["auto", "any", "tool", "none"]
    name: Optional[StrictStr] = None
    disable_parallel_tool_use: Optional[StrictBool] = None

    @model_validator(mode="after")
    def _named(self):
        if self.type == "tool" and self.name is None:
            raise ValueError("a tool_choice of type 'tool' needs a name")
        return self


class ThinkingConfig(_Strict):
    """``thinking``: ``enabled`` (with ``budget_tokens``), ``adaptive`` or
    ``between_tools`` turn the template's thinking on, ``disabled`` off."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Optional[StrictInt] = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _budget(self):
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("thinking of type 'enabled' needs budget_tokens")
        return self


class JSONOutputFormat(_Strict):
    """Structured output: the answer is JSON valid for ``schema``."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    """``output_config``: ``format`` constrains the output; ``effort`` (``low``,
    ``medium``, ``high``, ``xhigh``, ``max``) sets the thinking budget."""

    format: Optional[JSONOutputFormat] = None
    effort: Optional[StrictStr] = None


class EditAmount(_Strict):
    """A context edit's amount: ``trigger`` (``input_tokens`` or ``tool_uses``), ``keep``
    (``tool_uses`` or ``thinking_turns``), ``clear_at_least`` (``input_tokens``)."""

    type: StrictStr
    value: StrictInt = Field(ge=0)


class ContextEdit(_Strict):
    """One of ``context_management.edits``: ``clear_tool_uses_20250919`` (older tool
    results, and optionally their calls' inputs, replaced by a placeholder once the prompt
    passes ``trigger``) or ``clear_thinking_20251015`` (thinking of older turns dropped,
    ``keep`` the latest ones or ``"all"``). Other fields as Anthropic documents them."""

    type: StrictStr
    trigger: Optional[EditAmount] = None
    keep: Union[EditAmount, Literal["all"], None] = None
    clear_at_least: Optional[EditAmount] = None
    exclude_tools: Optional[list[StrictStr]] = None
    clear_tool_inputs: Union[StrictBool, list[StrictStr], None] = None


class ContextManagement(_Strict):
    """``context_management``: the edits to apply to the prompt before it is served."""

    edits: list[ContextEdit] = Field(default_factory=list)


# ---------------------------------------------------------------------- requests
class CountTokensRequest(_Strict):
    """``POST /v1/messages/count_tokens`` body (and the base of :class:`MessagesRequest`)."""

    model: Optional[StrictStr] = None
    system: Union[StrictStr, list[TextBlock], None] = None
    messages: list[MessageParam] = Field(min_length=1)
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[ThinkingConfig] = None
    output_config: Optional[OutputConfig] = None
    context_management: Optional[ContextManagement] = None
    output_format: Optional[JSONOutputFormat] = Field(
        default=None, description="the structured-outputs beta's form of output_config.format")


class MessagesRequest(CountTokensRequest, SamplingExtras):
    """``POST /v1/messages`` body (the gateway's sampling extensions as on
    ``/v1/chat/completions``, :class:`SamplingExtras`)."""

    max_tokens: StrictInt = Field(ge=1)
    stop_sequences: Optional[list[StrictStr]] = Field(default=None, max_length=MAX_STOP_SEQUENCES)
    stream: StrictBool = False
    temperature: Optional[float] = Field(default=None, ge=0, le=1)
    top_p: Optional[float] = Field(default=None, gt=0, le=1)
    top_k: Optional[StrictInt] = Field(default=None, ge=0)
    metadata: Optional[dict[str, Any]] = None


def parse(model: type[BaseModel], data: Any) -> Any:
    """Validate a request body against ``model``.

    Of a union's failed branches, the error reaching deepest into the data is reported
    (a list of blocks is judged as blocks, not as "not a string").

    Raises:
        APIError: 400 naming the offending field (dotted path, e.g.
            ``messages.0.content.1.input``) and, for a value of the wrong type, the type
            expected.
    """
    # Anthropic's messages do not name the field: the error body prefixes the param.
    return validate(model, data, lambda err: data_path(data, err), name_field=False)
