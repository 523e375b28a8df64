"""Request schemas for the OpenAI-compatible endpoints (pydantic v2).

Unknown fields are accepted and ignored, as OpenAI clients send many optional ones;
fields we do not support with a value that would change the result (``n`` > 1, image
content, ``echo``) are refused with a 400 naming the field.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gateway.errors import APIError

MAX_STOP_SEQUENCES = 16


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None
    name: Optional[str] = None

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0, le=2)
    top_p: Optional[float] = Field(default=None, gt=0, le=1)
    top_k: Optional[int] = Field(default=None, ge=-1)
    min_p: Optional[float] = Field(default=None, ge=0, le=1)
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(default=1, ge=1, le=1)
    presence_penalty: Optional[float] = Field(default=None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(default=None, gt=0)
    logit_bias: Optional[dict[str, float]] = None
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

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if v is not None:
            for k, b in v.items():
                if not k.lstrip("-").isdigit():
                    raise ValueError(f"logit_bias keys must be token ids, got {k!r}")
                if not -100 <= b <= 100:
                    raise ValueError("logit_bias values must be within [-100, 100]")
        return v


class ChatRequest(_Common):
    """``POST /v1/chat/completions`` body."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Any = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


class CompletionRequest(_Common):
    """``POST /v1/completions`` body."""

    prompt: Union[str, list[int]]
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


def parse(model: type[BaseModel], data: Any) -> Any:
    """Validate ``data`` against ``model``.

    Raises:
        APIError: 400 naming the first offending field (dotted path).
    """
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"] if not str(x).startswith(("str", "list[", "function")))
        raise APIError(400, f"invalid value for '{loc}': {err['msg']}", param=loc or None)
