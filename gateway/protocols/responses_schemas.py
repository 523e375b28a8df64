"""Request schemas of the OpenAI Responses API (``POST /v1/responses``, pydantic v2).

As for chat completions, unknown fields are accepted and ignored (``client_metadata``,
``prompt_cache_key``, ``safety_identifier``, ``service_tier``, ...), numbers must be
finite and types are strict (``"stream": "yes"`` or ``"max_output_tokens": "32"`` is a
400 naming the field and the type expected). Input items are told apart by ``type``; an
item with no ``type`` but a ``role`` is a message. The calls of hosted tools in an
earlier output (``web_search_call``, ...) are accepted and left out of the prompt; item
kinds the gateway cannot serve (images and files for a text model) are refused with a
400 naming the item's ``type``. Tools are function, ``namespace``, ``custom`` and
``local_shell`` tools, or hosted tools (any other ``type``), which the gateway does not run.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictStr, Tag, TypeAdapter,
                      ValidationError, field_validator, model_validator)
from pydantic_core import PydanticCustomError

from gateway.conversation.form import ImageRef, join_parts
from gateway.http.errors import APIError
from gateway.protocols.openai_schemas import TOOL_NAME, SamplingExtras, Strict, deepest, describe
from gateway.protocols.responses_tools import AllowedTools, HostedChoice, NamedFunction, ToolParam

MAX_METADATA = 16  # OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512


class TextContent(Strict):
    """A text part of a message: ``input_text`` (any role) or ``output_text`` (an
    assistant's earlier answer, as the API returns it)."""

    type: Literal["input_text", "output_text"]
    text: StrictStr


class ImageContent(Strict):
    """An ``input_image`` part: ``image_url`` is a data: URL or an http(s) URL (a
    ``file_id`` is refused: this server keeps no files)."""

    type: Literal["input_image"]
    image_url: Optional[StrictStr] = None
    file_id: Optional[StrictStr] = None
    detail: Optional[StrictStr] = None


class MessageItem(Strict):
    """A ``message`` input item (``type`` may be left out)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[StrictStr, list[Union[TextContent, ImageContent]]]
    id: Optional[str] = None

    def text(self) -> str:
        """The content as one string (parts joined, each image an ``IMAGE_MARK``)."""
        return self.text_and_images("input")[0]

    def text_and_images(self, param: str) -> tuple[str, list[ImageRef]]:
        """The content's text and images; ``param`` is the item's place in the request.

        Raises:
            APIError: 400 for an ``input_image`` without an ``image_url``.
        """
        return parts_text_and_images(self.content, f"{param}.content")


def parts_text_and_images(content, param: str) -> tuple[str, list[ImageRef]]:
    """A content (a string, or text and image parts) as its text, each image an
    ``IMAGE_MARK``, and its images; ``param`` is the content's place in the request.

    Raises:
        APIError: 400 for an ``input_image`` without an ``image_url``.
    """
    if isinstance(content, str):
        return content, []
    parts: list = []
    for j, p in enumerate(content):
        if isinstance(p, ImageContent):
            if p.image_url is None:
                raise APIError(400, "an input_image needs an image_url (a data: URL); file ids are not kept "
                               "by this server", param=f"{param}.{j}.image_url")
            parts.append(ImageRef(f"{param}.{j}.image_url", url=p.image_url))
        else:
            parts.append(p.text)
    return join_parts(parts)


class FunctionCallItem(Strict):
    """A call the assistant made earlier (``function_call`` item; ``namespace`` for a
    namespace tool's function)."""

    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr = Field(description="the arguments as a JSON text")
    namespace: Optional[StrictStr] = None
    id: Optional[str] = None


class CustomToolCallItem(Strict):
    """A call of a ``custom`` tool the assistant made earlier: ``input`` is its free-form text."""

    type: Literal["custom_tool_call"]
    call_id: StrictStr
    name: StrictStr
    input: StrictStr = ""
    id: Optional[str] = None


class LocalShellCallItem(Strict):
    """A ``local_shell`` call the assistant made earlier: ``action`` is what it ran
    (``{"type": "exec", "command": [...], ...}``)."""

    type: Literal["local_shell_call"]
    call_id: StrictStr
    action: dict[str, Any]
    id: Optional[str] = None


class FunctionCallOutputItem(Strict):
    """The result of call ``call_id`` (``function_call_output``, ``custom_tool_call_output``
    or ``local_shell_call_output``, whose call is named by ``call_id`` or ``id``)."""

    type: Literal["function_call_output", "custom_tool_call_output", "local_shell_call_output"]
    call_id: Optional[StrictStr] = None
    id: Optional[StrictStr] = None
    output: Union[StrictStr, list[Union[TextContent, ImageContent]]]

    @model_validator(mode="after")
    def _call(self):
        if self.call_id is None and (self.type != "local_shell_call_output" or self.id is None):
            raise PydanticCustomError("missing", "call_id is required")
        return self

    @property
    def of(self) -> str:
        """The id of the call this is the output of."""
        return self.call_id if self.call_id is not None else self.id

    def text(self) -> str:
        """The output as one string (parts joined, each image an ``IMAGE_MARK``)."""
        return self.text_and_images("input")[0]

    def text_and_images(self, param: str) -> tuple[str, list[ImageRef]]:
        """The output's text and images (Codex's view_image answers with an image);
        ``param`` is the item's place in the request.

        Raises:
            APIError: 400 for an ``input_image`` without an ``image_url``.
        """
        return parts_text_and_images(self.output, f"{param}.output")


class ReasoningPart(Strict):
    """A text part of a ``reasoning`` item (its content or its summary)."""

    type: Literal["reasoning_text", "summary_text"]
    text: StrictStr


class ReasoningItem(Strict):
    """An earlier answer's reasoning (``reasoning`` item, as the API returns it): its
    sealed ``encrypted_content`` (opened by the gateway that made it), else its
    ``content``, else its ``summary``, becomes the next assistant turn's reasoning."""

    type: Literal["reasoning"]
    summary: list[ReasoningPart] = Field(default_factory=list)
    content: Optional[list[ReasoningPart]] = None
    encrypted_content: Optional[StrictStr] = None
    id: Optional[str] = None

    def text(self) -> str:
        """The reasoning text: the content parts joined, else the summary's."""
        return "".join(p.text for p in (self.content if self.content else self.summary))


# The calls of hosted tools (which the gateway does not run) in an earlier answer: nothing
# of them reaches the prompt.
HOSTED_CALLS = ("web_search_call", "file_search_call", "image_generation_call", "code_interpreter_call",
                "computer_call", "computer_call_output", "mcp_call", "mcp_list_tools", "mcp_approval_request",
                "mcp_approval_response")


class HostedCallItem(Strict):
    """A hosted tool's call or result in an earlier answer: accepted, left out."""

    type: Literal[HOSTED_CALLS]
    id: Optional[str] = None


_OUTPUTS = ("function_call_output", "custom_tool_call_output", "local_shell_call_output")


def _item_kind(value: Any) -> Optional[str]:
    kind = value.get("type", "message" if "role" in value else None) if isinstance(value, dict) \
        else getattr(value, "type", None)
    return "output" if kind in _OUTPUTS else "hosted" if kind in HOSTED_CALLS else kind


InputItem = Annotated[
    Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
          Annotated[CustomToolCallItem, Tag("custom_tool_call")],
          Annotated[LocalShellCallItem, Tag("local_shell_call")],
          Annotated[FunctionCallOutputItem, Tag("output")],
          Annotated[ReasoningItem, Tag("reasoning")], Annotated[HostedCallItem, Tag("hosted")]],
    Discriminator(_item_kind, custom_error_type="invalid_item",
                  custom_error_message="unsupported input item type (expected message, function_call, "
                                       "function_call_output, custom_tool_call, custom_tool_call_output, "
                                       "local_shell_call, local_shell_call_output or reasoning)"),
]
ITEMS = TypeAdapter(list[InputItem])


class TextFormat(BaseModel):
    """``text.format``: free text, any JSON object, or JSON valid for ``schema``."""

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = Field(default=None, pattern=TOOL_NAME)
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[StrictBool] = None


class TextConfig(Strict):
    """``text``: the output's ``format`` (``verbosity`` and the rest are ignored)."""

    format: Optional[TextFormat] = None


class ReasoningConfig(Strict):
    """``reasoning``: ``effort`` ``none`` turns thinking off, any other effort turns it
    on (the chat template's ``enable_thinking``); ``summary`` is accepted and ignored."""

    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = None
    summary: Optional[str] = None


class ResponsesRequest(SamplingExtras):
    """``POST /v1/responses`` body (``input`` items are checked by :func:`parse_request`;
    the gateway's sampling extensions as on ``/v1/chat/completions``, :class:`SamplingExtras`)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    model: Optional[str] = None
    input: Union[StrictStr, list[Any], None] = None
    instructions: Optional[StrictStr] = None
    tools: Optional[list[ToolParam]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedFunction, AllowedTools, HostedChoice, None] = None
    parallel_tool_calls: Optional[StrictBool] = None
    text: Optional[TextConfig] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0, le=2)
    top_p: Optional[float] = Field(default=None, gt=0, le=1)
    stream: Optional[StrictBool] = False  # null: not streamed (sglang-router 0.3.2 forwards "stream": null)
    store: StrictBool = True
    previous_response_id: Optional[StrictStr] = None
    metadata: Optional[dict[str, StrictStr]] = None
    reasoning: Optional[ReasoningConfig] = None
    background: Optional[Literal[False]] = None
    user: Optional[str] = None
    include: Optional[list[StrictStr]] = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v):
        if v is not None:
            if len(v) > MAX_METADATA:
                raise ValueError(f"at most {MAX_METADATA} metadata pairs")
            for k, s in v.items():
                if len(k) > 64 or len(s) > 512:
                    raise ValueError("metadata keys are at most 64 characters, values at most 512")
        return v


TOOL_TAGS = frozenset({"function", "namespace", "custom", "local_shell", "hosted"})
TAGS = frozenset({"message", "function_call", "custom_tool_call", "local_shell_call", "output", "reasoning", "hosted"})


def _loc(err: dict, prefix: tuple = ()) -> str:
    """The dotted path of a pydantic error, without the parts unions add (type names,
    and the item kind after an input item's index)."""
    loc = list(err["loc"])
    if prefix and len(loc) > 1 and isinstance(loc[0], int) and loc[1] in TAGS:
        del loc[1]
    loc = [x for i, x in enumerate(loc)  # a tool's kind after its index: tools.0.function.name -> tools.0.name
           if not (i >= 2 and loc[0] == "tools" and isinstance(loc[i - 1], int) and x in TOOL_TAGS)]
    parts = [str(x) for x in (*prefix, *loc)
             if not (isinstance(x, str) and (x in {"str", "list", "dict"} or "[" in x or x[:1].isupper()))]
    if err["type"] == "invalid_item":
        parts.append("type")
    return ".".join(parts)


def _fail(e: ValidationError, prefix: tuple = ()) -> APIError:
    """A 400 for the deepest error (in a union, the branch that got furthest), naming
    the type expected for a value of the wrong type."""
    errors = e.errors()
    loc, group = deepest(errors, [_loc(err, prefix) for err in errors])
    return APIError(400, describe(group, loc), param=loc or None)


def parse_items(items: list[Any], param: str = "input") -> list:
    """Validate input items (already-stored ones too).

    Raises:
        APIError: 400 naming the offending field, e.g. ``input.2.type``.
    """
    try:
        return ITEMS.validate_python(items)
    except ValidationError as e:
        raise _fail(e, (param,))


def parse_request(data: Any) -> tuple[ResponsesRequest, list]:
    """The request and its input items (a string input is one user message; no input,
    no items: e.g. a continuation of ``previous_response_id``).

    Raises:
        APIError: 400 naming the first offending field (dotted path).
    """
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        req = ResponsesRequest.model_validate(data)
    except ValidationError as e:
        raise _fail(e)
    if req.input is None:
        return req, []
    if isinstance(req.input, str):
        return req, [MessageItem(role="user", content=req.input)]
    return req, parse_items(req.input)
