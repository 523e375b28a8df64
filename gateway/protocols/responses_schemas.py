"""Request schemas of the OpenAI Responses API (``POST /v1/responses``, pydantic v2).

As for chat completions, unknown fields are accepted and ignored, numbers must be
finite and types are strict (``"stream": "yes"`` or ``"max_output_tokens": "32"`` is a
400 naming the field and the type expected). Input items are told apart by ``type``; an
item with no ``type`` but a ``role`` is a message. Item kinds this gateway cannot serve (images,
files, built-in tools) are refused with a 400 naming the item's ``type``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictStr, Tag, TypeAdapter,
                      ValidationError, field_validator)

from gateway.http.errors import APIError
from gateway.protocols.openai_schemas import TOOL_NAME, deepest, describe

MAX_METADATA = 16  # OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512


class TextContent(BaseModel):
    """A text part of a message: ``input_text`` (any role) or ``output_text`` (an
    assistant's earlier answer, as the API returns it)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["input_text", "output_text"]
    text: StrictStr


class MessageItem(BaseModel):
    """A ``message`` input item (``type`` may be left out)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[StrictStr, list[TextContent]]
    id: Optional[str] = None

    def text(self) -> str:
        """The content as one string (parts joined)."""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(BaseModel):
    """A call the assistant made earlier (``function_call`` item)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr = Field(description="the arguments as a JSON text")
    id: Optional[str] = None


class FunctionCallOutputItem(BaseModel):
    """The result of call ``call_id`` (``function_call_output`` item)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: Union[StrictStr, list[TextContent]]

    def text(self) -> str:
        """The output as one string (parts joined)."""
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningPart(BaseModel):
    """A text part of a ``reasoning`` item (its content or its summary)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["reasoning_text", "summary_text"]
    text: StrictStr


class ReasoningItem(BaseModel):
    """An earlier answer's reasoning (``reasoning`` item, as the API returns it): its
    ``content`` (else its ``summary``) becomes the next assistant turn's reasoning."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["reasoning"]
    summary: list[ReasoningPart] = Field(default_factory=list)
    content: Optional[list[ReasoningPart]] = None
    id: Optional[str] = None

    def text(self) -> str:
        """The reasoning text: the content parts joined, else the summary's."""
        return "".join(p.text for p in (self.content if self.content else self.summary))


def _item_kind(value: Any) -> Optional[str]:
    if isinstance(value, dict):
        return value.get("type", "message" if "role" in value else None)
    return getattr(value, "type", None)


InputItem = Annotated[
    Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
          Annotated[FunctionCallOutputItem, Tag("function_call_output")],
          Annotated[ReasoningItem, Tag("reasoning")]],
    Discriminator(_item_kind, custom_error_type="invalid_item",
                  custom_error_message="unsupported input item type (expected message, function_call, "
                                       "function_call_output or reasoning)"),
]
ITEMS = TypeAdapter(list[InputItem])


class FunctionToolParam(BaseModel):
    """A function the model may call (flat, unlike chat completions' ``function`` object)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = Field(default=None, description="a JSON Schema of the arguments object")
    strict: Optional[StrictBool] = None


class NamedFunction(BaseModel):
    """``tool_choice`` naming one function the model must call."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["function"]
    name: StrictStr


class TextFormat(BaseModel):
    """``text.format``: free text, any JSON object, or JSON valid for ``schema``."""

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = Field(default=None, pattern=TOOL_NAME)
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[StrictBool] = None


class TextConfig(BaseModel):
    """``text``: the output's ``format`` (``verbosity`` and the rest are ignored)."""

    model_config = ConfigDict(extra="allow", strict=True)
    format: Optional[TextFormat] = None


class ReasoningConfig(BaseModel):
    """``reasoning``: ``effort`` ``none`` turns thinking off, any other effort turns it
    on (the chat template's ``enable_thinking``); ``summary`` is accepted and ignored."""

    model_config = ConfigDict(extra="allow", strict=True)
    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = None
    summary: Optional[str] = None


class ResponsesRequest(BaseModel):
    """``POST /v1/responses`` body (``input`` items are checked by :func:`parse_request`)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    model: Optional[str] = None
    input: Union[StrictStr, list[Any], None] = None
    instructions: Optional[StrictStr] = None
    tools: Optional[list[FunctionToolParam]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedFunction, None] = None
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


TAGS = frozenset({"message", "function_call", "function_call_output", "reasoning"})


def _loc(err: dict, prefix: tuple = ()) -> str:
    """The dotted path of a pydantic error, without the parts unions add (type names,
    and the item kind after an input item's index)."""
    loc = list(err["loc"])
    if prefix and len(loc) > 1 and isinstance(loc[0], int) and loc[1] in TAGS:
        del loc[1]
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
