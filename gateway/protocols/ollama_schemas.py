"""Ollama's request bodies (ollama/ollama ``api/types.go``, ``docs/api.md``) and what they
mean to the gateway: ``options`` as sampling settings, ``format`` as an output schema,
``keep_alive`` as seconds, ``think`` as a template argument.

Unknown fields, and the ``options`` the engine has no use for (``num_ctx``, ``num_gpu``,
``mirostat`` and the rest), are accepted and ignored, as Ollama ignores what its runner
does not use. A field of the wrong type is a 400 naming it.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gateway.conversation.form import Sampling
from gateway.http.errors import APIError
from gateway.models.spec import parse_keep_alive

# The Ollama release whose API this follows (``GET /api/version``; clients compare it to
# the releases that added a field, e.g. ``think`` in 0.9, ``dimensions`` in 0.11).
OLLAMA_VERSION = "0.12.6"


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    @field_validator("keep_alive", check_fields=False)
    @classmethod
    def _duration(cls, v):
        if v is not None:
            parse_keep_alive(v)  # ValueError: a 400 naming keep_alive
        return v


class Options(_Body):
    """``options``: the fields below are the ones the engine applies; the rest are kept
    as extra fields and ignored."""

    num_predict: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    repeat_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None

    def sampling(self) -> Sampling:
        """The sampling settings: ``num_predict`` below 1 (Ollama's -1 "no limit", -2
        "fill the context") leaves the limit to the server (bounded by the context)."""
        n = self.num_predict
        return Sampling(max_tokens=n if n is not None and n > 0 else None, temperature=self.temperature,
                        top_p=self.top_p, top_k=self.top_k if self.top_k is None or self.top_k > 0 else 0,
                        min_p=self.min_p, seed=self.seed, presence_penalty=self.presence_penalty,
                        frequency_penalty=self.frequency_penalty, repetition_penalty=self.repeat_penalty)

    def stops(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stop if s]


class ToolFunctionCall(_Body):
    name: str
    arguments: Union[dict[str, Any], str] = Field(default_factory=dict)
    index: Optional[int] = None


class ToolCallParam(_Body):
    id: Optional[str] = None
    function: ToolFunctionCall


class Message(_Body):
    role: str
    content: Optional[str] = ""
    thinking: Optional[str] = None
    images: Optional[list[str]] = None
    tool_calls: Optional[list[ToolCallParam]] = None
    tool_name: Optional[str] = None
    tool_call_id: Optional[str] = None


class ToolFunction(_Body):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None


class Tool(_Body):
    type: str = "function"
    function: ToolFunction


class _Generating(_Body):
    model: Optional[str] = None
    stream: Optional[bool] = True
    format: Optional[Union[str, dict[str, Any]]] = None
    options: Optional[Options] = None
    keep_alive: Optional[Union[int, float, str]] = None
    think: Optional[Union[bool, str]] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)

    def opts(self) -> Options:
        return self.options or Options()

    def output_schema(self) -> Optional[dict]:
        """``format``: ``"json"`` (any JSON object), a JSON schema, or nothing (``""``).

        Raises:
            APIError: 400 for another string.
        """
        f = self.format
        if f is None or f == "":
            return None
        if f == "json":
            return {"type": "object"}
        if isinstance(f, dict):
            return f
        try:  # a schema sent as a JSON string
            parsed = json.loads(f)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            return parsed
        raise APIError(400, f'invalid format: {f!r}: expected "json" or a JSON schema', param="format")

    def template_kwargs(self) -> dict:
        """``think`` for the chat template: ``enable_thinking`` (bool, or True for a level:
        ``high``, ``medium``, ``low``) and the level as ``reasoning_effort``.

        Raises:
            APIError: 400 for a level that is not one of Ollama's.
        """
        t = self.think
        if t is None:
            return {}
        if isinstance(t, bool):
            return {"enable_thinking": t}
        if t not in ("high", "medium", "low"):
            raise APIError(400, f"invalid think value: {t!r} (must be true, false, \"high\", \"medium\" or \"low\")",
                           param="think")
        return {"enable_thinking": True, "reasoning_effort": t}


class ChatRequest(_Generating):
    """``POST /api/chat``. ``tool_choice`` (OpenAI's form: ``auto``, ``none``, ``required``
    or ``{"type": "function", "function": {"name": ...}}``) is the gateway's extension:
    Ollama has none, and offers tools as ``auto``."""

    messages: list[Message] = Field(default_factory=list)
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None


class GenerateRequest(_Generating):
    """``POST /api/generate``."""

    prompt: Optional[str] = ""
    suffix: Optional[str] = None
    system: Optional[str] = None
    template: Optional[str] = None
    context: Optional[list[int]] = None
    raw: Optional[bool] = False
    images: Optional[list[str]] = None


class EmbedRequest(_Body):
    """``POST /api/embed``."""

    model: Optional[str] = None
    input: Union[str, list[str]] = ""
    truncate: Optional[bool] = True
    dimensions: Optional[int] = None
    options: Optional[Options] = None
    keep_alive: Optional[Union[int, float, str]] = None


class LegacyEmbeddingsRequest(_Body):
    """``POST /api/embeddings`` (the older form: one ``prompt``)."""

    model: Optional[str] = None
    prompt: Optional[str] = ""
    options: Optional[Options] = None
    keep_alive: Optional[Union[int, float, str]] = None


class ModelRequest(_Body):
    """``/api/show``, ``/api/delete``, ``/api/pull``, ``/api/push``: ``model`` (``name``, its
    older spelling, too)."""

    model: Optional[str] = None
    name: Optional[str] = None
    stream: Optional[bool] = True

    @property
    def target(self) -> str:
        """Raises:
            APIError: 400 when neither ``model`` nor ``name`` is given."""
        name = self.model or self.name
        if not name:
            raise APIError(400, "model is required", param="model")
        return name


class CopyRequest(_Body):
    source: str
    destination: str


class CreateRequest(ModelRequest):
    from_: Optional[str] = Field(default=None, alias="from")
    files: Optional[dict[str, str]] = None
    adapters: Optional[dict[str, str]] = None
    template: Optional[str] = None
    system: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    messages: Optional[list[Any]] = None
    quantize: Optional[str] = None
    license: Optional[Any] = None
    modelfile: Optional[str] = None


def parse(model: type[BaseModel], body: Any):
    """``body`` as ``model``.

    Raises:
        APIError: 400 for a body that is not a JSON object, or a field of the wrong type
            (named in the message, as Ollama names it).
    """
    if not isinstance(body, dict):
        raise APIError(400, "invalid request: the body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise APIError(400, f"invalid {where}: {err['msg']}", param=where or None) from None


def keep_alive_seconds(value) -> Optional[float]:
    """``keep_alive`` (a duration such as ``"5m"``, or seconds; negative: forever) in
    seconds; None for forever.

    Raises:
        APIError: 400 for something that is not a duration.
    """
    try:
        return parse_keep_alive(value)
    except ValueError as e:
        raise APIError(400, str(e), param="keep_alive") from None


def timestamp(at: Optional[float] = None) -> str:
    """``at`` (seconds since the epoch; now when None) in RFC 3339, UTC, as Go writes times."""
    t = datetime.fromtimestamp(at, timezone.utc) if at is not None else datetime.now(timezone.utc)
    return t.isoformat().replace("+00:00", "Z")


def served_name(front, name: Optional[str]) -> Optional[str]:
    """``name`` as the gateway serves it: Ollama's clients add or drop the tag ``:latest``
    (``llama3`` is ``llama3:latest``), so a name not served is tried with it added or
    removed; as it is when neither is served."""
    if not name or front.models.find(name) is not None:
        return name
    other = name[: -len(":latest")] if name.endswith(":latest") else f"{name}:latest" if ":" not in name else None
    return other if other is not None and front.models.find(other) is not None else name
