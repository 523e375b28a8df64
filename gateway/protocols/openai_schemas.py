"""Request schemas for the OpenAI-compatible endpoints (pydantic v2).

Types are strict, as on OpenAI's API: ``"stream": "yes"`` or ``"max_tokens": "32"`` is a
400 naming the field and the type expected (an integer is a valid number, a boolean is
not). Unknown fields are accepted and ignored, as OpenAI clients send many optional ones;
fields we do not support with a value that would change the result (``n`` > 1, ``echo``)
are refused with a 400 naming the field. Numbers must be finite (JSON's
non-standard ``NaN``/``Infinity`` are refused). Constraints checked by validators are
also written into the JSON schema (:func:`_document`), so ``GET /openapi.json`` states them.
"""

from __future__ import annotations

from typing import Annotated, Any, Callable, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from gateway.conversation.form import ImageRef, join_parts
from gateway.http.errors import APIError

MAX_STOP_SEQUENCES = 16
MAX_TOKEN_ID = 2**31 - 1  # token ids are int32 inside MLX; larger ones cannot index logits
SEED_RANGE = (-(2**63), 2**64 - 1)  # int64 (OpenAI) or uint64 (MLX keys); taken modulo 2**64
# apply_chat_template's own arguments: the gateway sets them, so a request may not
# (``tokenize=False`` would make the "tokens" a string, ``chat_template`` swap the template).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def _document(kind: str, **constraints: Any) -> Callable[[dict], None]:
    """A ``json_schema_extra`` hook adding ``constraints`` to the ``type == kind`` branch
    of a field's schema (its ``anyOf`` branch, or the schema itself)."""

    def hook(schema: dict) -> None:
        for branch in schema.get("anyOf", [schema]):
            if branch.get("type") == kind:
                branch.update(constraints)

    return hook


class Strict(BaseModel):
    """A body part as the real API reads it: unknown fields are kept, known ones are not coerced."""

    model_config = ConfigDict(extra="allow", strict=True)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ImageURL(Strict):
    url: str
    detail: Optional[str] = None


class ImagePart(Strict):
    """An image (``image_url``: a data: URL, or an http(s) URL the server may fetch)."""

    type: Literal["image_url"]
    image_url: ImageURL


TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function and schema names


class FunctionCall(Strict):
    name: str
    arguments: str = Field(description="the arguments as a JSON text")


class ToolCall(Strict):
    """A call the assistant made earlier in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]], None] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None
    name: Optional[str] = None

    def text(self) -> str:
        """The content as one string (text parts joined, each image an ``IMAGE_MARK``)."""
        return self.text_and_images(0)[0]

    def text_and_images(self, i: int) -> tuple[str, list[ImageRef]]:
        """The content's text and images (``i``: the message's index, for error messages)."""
        if self.content is None:
            return "", []
        if isinstance(self.content, str):
            return self.content, []
        return join_parts([ImageRef(f"messages.{i}.content.{j}.image_url", url=p.image_url.url)
                           if isinstance(p, ImagePart) else p.text for j, p in enumerate(self.content)])


class FunctionDef(Strict):
    name: str = Field(pattern=TOOL_NAME)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = Field(default=None, description="a JSON Schema of the arguments object")
    strict: Optional[StrictBool] = None


class Tool(Strict):
    """A function the model may call (``tools`` item)."""

    type: Literal["function"]
    function: FunctionDef


class ChosenFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    """``tool_choice`` naming one function the model must call."""

    type: Literal["function"]
    function: ChosenFunction


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)
    name: str = Field(pattern=TOOL_NAME)
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[StrictBool] = None


class ResponseFormat(Strict):
    """``response_format``: free text, any JSON object, or JSON valid for a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingExtras(BaseModel):
    """Sampling settings beyond OpenAI's own, taken by every generating route as plain body
    fields (SDKs send them through ``extra_body``): ``top_k``, ``min_p``, ``seed``, the
    penalties, ``logit_bias`` and ``ignore_eos`` (vLLM's and SGLang's: the model's end
    token does not end the answer, only ``max_tokens`` and stop strings do; benchmarks
    use it for answers of a fixed length)."""

    top_k: Optional[int] = Field(default=None, ge=-1)
    min_p: Optional[float] = Field(default=None, ge=0, le=1)
    seed: Optional[int] = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    presence_penalty: Optional[float] = Field(default=None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2, le=2)
    # logits are divided or multiplied by it in float32: near 0 they overflow to NaN logprobs
    repetition_penalty: Optional[float] = Field(default=None, ge=0.01, le=100)
    logit_bias: Optional[dict[str, float]] = Field(default=None, json_schema_extra=_document(
        "object", propertyNames={"pattern": "^[0-9]{1,10}$"},
        additionalProperties={"type": "number", "minimum": -100, "maximum": 100}))
    ignore_eos: bool = False

    @field_validator("seed")
    @classmethod
    def _seed(cls, v):
        return None if v is None else v % 2**64  # mx.random.key takes a uint64

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if v is not None:
            for k, b in v.items():
                if not (k.isascii() and k.isdigit() and int(k) <= MAX_TOKEN_ID):
                    raise ValueError(f"logit_bias keys must be token ids (0 to {MAX_TOKEN_ID}), got {k!r}")
                if not -100 <= b <= 100:
                    raise ValueError("logit_bias values must be within [-100, 100]")
        return v


class _Common(SamplingExtras):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0, le=2)
    top_p: Optional[float] = Field(default=None, gt=0, le=1)
    stop: Union[str, list[str], None] = Field(
        default=None, json_schema_extra=_document("array", maxItems=MAX_STOP_SEQUENCES))
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(default=1, ge=1, le=1)
    user: Optional[str] = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if isinstance(v, str):
            v = [v]
        if v is not None:
            if len(v) > MAX_STOP_SEQUENCES:
                raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
            v = [s for s in v if s]
        return v or None


class ChatRequest(_Common):
    """``POST /v1/chat/completions`` body."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[StrictBool] = None
    response_format: Optional[ResponseFormat] = None
    chat_template_kwargs: Optional[dict[str, Any]] = Field(default=None, json_schema_extra=_document(
        "object", propertyNames={"not": {"enum": sorted(RESERVED_TEMPLATE_KWARGS)}},
        properties={"enable_thinking": {"type": "boolean"}}))

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v):
        reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(v or {}))
        if reserved:
            raise ValueError(f"{reserved[0]!r} is set by the server, not by chat_template_kwargs")
        thinking = (v or {}).get("enable_thinking", False)
        if not isinstance(thinking, bool):  # "false" would be true to the template
            raise PydanticCustomError("enable_thinking_type", "enable_thinking: expected a boolean, but got {got} "
                                      "instead", {"got": json_type(thinking)})
        return v


class CompletionRequest(_Common):
    """``POST /v1/completions`` body."""

    prompt: Union[str, list[int]] = Field(json_schema_extra=_document("array", minItems=1, items={
        "type": "integer", "minimum": 0}))
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    echo: Literal[False] = False

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v


# pydantic's type errors -> the JSON type expected, in OpenAI's words.
EXPECTED = {"string_type": "a string", "int_type": "an integer", "float_type": "a number", "bool_type": "a boolean",
            "list_type": "an array", "dict_type": "an object", "model_type": "an object",
            "model_attributes_type": "an object", "none_required": "null"}


def json_type(value: Any) -> str:
    """The JSON type of a parsed JSON value, with its article (``a string``, ``an integer``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    return {str: "a string", float: "a number", list: "an array", dict: "an object"}.get(type(value), "a value")


def describe(errors: list[dict], loc: Optional[str] = None) -> str:
    """The message for pydantic ``errors`` at one field ``loc`` (all of a union's
    branches, when it has several): ``invalid type for 'stream': expected a boolean, but
    got a string instead`` when each is a wrong type, else ``invalid value for ...`` with
    the first error's message. Without ``loc``, the part after the field's name."""
    expected = [EXPECTED.get(e["type"]) for e in errors]
    if errors and all(expected):
        kinds = " or ".join(dict.fromkeys(expected))
        detail = f"expected {kinds}, but got {json_type(errors[0].get('input'))} instead"
        return detail if loc is None else f"invalid type for '{loc}': {detail}"
    return errors[0]["msg"] if loc is None else f"invalid value for '{loc}': {errors[0]['msg']}"


def deepest(errors: list[dict], paths: list[str]) -> tuple[str, list[dict]]:
    """The path reaching deepest into the data among ``errors`` (their dotted ``paths``;
    the first on a tie), and the errors at that path: in a union, the branch that got
    furthest tells what is wrong (a list of parts is judged as parts, not as "not a
    string")."""
    depth = [len(p.split(".")) if p else 0 for p in paths]
    best = paths[max(range(len(errors)), key=depth.__getitem__)]
    return best, [e for e, p in zip(errors, paths) if p == best]


def data_path(data: Any, err: dict) -> str:
    """The dotted path of a validation error in the request's own terms: the parts of
    pydantic's location that are not keys or indexes of the data (a union's branches,
    ``str``, ``list[...]``, a discriminator's tag such as a content part's ``text``) are
    dropped; a missing field keeps its name."""
    loc, parts, node = err["loc"], [], data
    for i, part in enumerate(loc):
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif not (err["type"] == "missing" and i == len(loc) - 1):
            continue
        parts.append(str(part))
    return ".".join(parts)


def parse(model: type[BaseModel], data: Any) -> Any:
    """Validate ``data`` against ``model``. Types are strict: no string is read as a
    number or a boolean, no number or boolean as a string, no boolean as a number (an
    integer is a valid number).

    Raises:
        APIError: 400 naming the offending field (dotted path, e.g. ``messages.0.content``)
            and, for a value of the wrong type, the type expected.
    """
    return validate(model, data, lambda err: data_path(data, err))


def validate(model: type[BaseModel], data: Any, path: Callable[[dict], str], name_field: bool = True) -> Any:
    """Validate the JSON object ``data`` against ``model``; each API's ``parse``.

    ``path`` gives a pydantic error's dotted parameter path; of a union's failed branches
    the one reaching deepest into the data is reported (:func:`deepest`). With
    ``name_field`` the message names the field (OpenAI's style), else only what is wrong.

    Raises:
        APIError: 400 with ``param`` the offending field's path.
    """
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        loc, group = deepest(errors, [path(err) for err in errors])
        raise APIError(400, describe(group, loc if name_field else None), param=loc or None)
