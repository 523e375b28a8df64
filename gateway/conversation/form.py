"""The one internal request form that every protocol maps into, and the events that
come back out.

OpenAI chat completions, OpenAI Responses and Anthropic Messages are thin adapters
(:mod:`gateway.protocols`): each turns its JSON into a :class:`Conversation` and turns
the events of :class:`gateway.conversation.run.Run` into its own answer
(:mod:`gateway.protocols.respond`). Nothing below the adapters knows which protocol a request came in on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from scheduler.request import TokenEvent


@dataclass
class ToolCall:
    """A call the assistant made: ``arguments`` is a JSON text, or, for a ``custom``
    tool (``kind``), the tool's free-form input as it is. ``namespace`` is the group of a
    Responses ``namespace`` tool's function (``name`` is the function's own name)."""

    id: str
    name: str
    arguments: str
    namespace: Optional[str] = None
    kind: str = "function"


# Where an image sits in a turn's text (a private-use character, removed from client text).
IMAGE_MARK = "\U000F0001"


@dataclass
class ImageRef:
    """An image of a turn, as the request gave it: a ``url`` (a ``data:`` URL, or an
    http(s) URL fetched when the server allows it) or base64 ``data`` with its
    ``media_type`` (Anthropic's base64 source). ``param`` is where it is in the request
    (for error messages)."""

    param: str
    url: Optional[str] = None
    data: Optional[str] = None
    media_type: Optional[str] = None


def join_parts(parts: list) -> tuple[str, list[ImageRef]]:
    """A turn's text and images from its content parts in order (strings and
    :class:`ImageRef` s): each image is :data:`IMAGE_MARK` in the text."""
    text, images = [], []
    for p in parts:
        if isinstance(p, ImageRef):
            text.append(IMAGE_MARK)
            images.append(p)
        else:
            text.append(p.replace(IMAGE_MARK, ""))
    return "".join(text), images


@dataclass
class Turn:
    """One message. ``role`` is ``system``, ``user``, ``assistant`` or ``tool``;
    ``tool_call_id`` (and ``name``, when known) tie a tool result to its call.
    ``breaks`` are cache breakpoints inside it (Anthropic's ``cache_control``):
    ``(character offset in text, seconds to keep the prefix)``; the prefix up to there is
    snapshotted and kept. ``images`` are its images, each at an :data:`IMAGE_MARK` of
    ``text``, in order."""

    role: str
    text: str = ""
    reasoning: Optional[str] = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: Optional[str] = None
    name: Optional[str] = None
    breaks: list[tuple[int, float]] = field(default_factory=list)
    images: list[ImageRef] = field(default_factory=list)


@dataclass
class FunctionTool:
    """A tool the model may call. ``parameters`` is a JSON Schema (None: no
    arguments); ``param`` is where the tool sits in the request and ``schema_key``
    its schema's field, for error messages (e.g. ``tools.0.function`` and
    ``parameters`` in OpenAI's form, ``tools.0`` and ``input_schema`` in Anthropic's).

    ``strict``: the arguments must follow the schema exactly, so a keyword the grammar
    engine cannot enforce is a 400; otherwise the schema describes the tool to the model
    and is enforced as far as it can be (:mod:`gateway.conversation.call_grammar`).
    ``namespace``: the group of a Responses ``namespace`` tool's function. ``kind``
    ``custom``: the tool takes free-form text (Responses ``custom`` tools), held to
    ``grammar`` (``(syntax, definition)``, syntax ``lark`` or ``regex``) when given;
    ``local_shell``: a function whose calls are answered as Responses ``local_shell_call``
    items; ``function`` otherwise.
    ``deferred``: left out of the prompt until the conversation loads it (Anthropic's
    ``defer_loading`` with a ``tool_reference`` in a tool result); its calls are still
    understood."""

    name: str
    description: Optional[str] = None
    parameters: Optional[dict] = None
    param: str = "tools"
    schema_key: str = "parameters"
    strict: bool = False
    namespace: Optional[str] = None
    kind: str = "function"
    grammar: Optional[tuple[str, str]] = None
    deferred: bool = False


@dataclass
class Sampling:
    """Decoding settings as the client gave them (None: the server's default).

    ``unset_max_tokens`` is the protocol's own answer length when the client gives none
    and the operator set no ``--max-tokens`` (None: until the model stops or the context ends).
    """

    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    logprobs: bool = False
    top_logprobs: int = 0
    ignore_eos: bool = False
    unset_max_tokens: Optional[int] = None


@dataclass
class Conversation:
    """A chat request, whatever protocol it came in on; or, with ``raw``, a completions
    prompt (text or token ids) sent as it is: no template, no tools, no reasoning split.

    ``tool_choice`` is ``none``, ``auto``, ``required`` or ``function`` (then
    ``forced_tool`` names it). ``output_schema`` is a JSON Schema the answer must match
    (None: free text); ``output_param`` names it in error messages; ``output_strict``: its
    objects allow no property they do not name, unless they say so. ``template_kwargs``
    go to the chat template (e.g. ``enable_thinking``).
    """

    turns: list[Turn]
    sampling: Sampling = field(default_factory=Sampling)
    tools: list[FunctionTool] = field(default_factory=list)
    tool_choice: str = "auto"
    forced_tool: Optional[str] = None
    parallel_tool_calls: bool = True
    output_schema: Optional[dict] = None
    output_param: str = "response_format"
    output_strict: bool = False
    stop: list[str] = field(default_factory=list)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    model: Optional[str] = None
    stream: bool = False
    continue_final: bool = False  # the last turn is an assistant's, to be continued (a prefill)
    thinking_budget: Optional[int] = None  # tokens of reasoning before the thinking block is closed
    edits: list[Any] = field(default_factory=list)  # context edits to apply (gateway.conversation.context_edits)
    allowed_tools: Optional[list[str]] = None  # the offered names the model may call (None: every tool)
    raw: Optional[str | list[int]] = None
    context: Optional[list[int]] = None  # token ids before the prompt (Ollama's /api/generate context)


# ---------------------------------------------------------------------- events
@dataclass
class ToolCallDelta:
    """A piece of tool call ``index``: its first piece has ``id`` and ``name``, later
    ones add to ``arguments`` (see :mod:`gateway.conversation.tool_stream`)."""

    index: int
    arguments: str = ""
    id: Optional[str] = None
    name: Optional[str] = None


@dataclass
class Piece:
    """What one batch of generated tokens adds to the answer: ``text``, ``reasoning``
    (thinking) text, tool-call pieces, and the ``tokens`` behind them (with logprobs
    when asked for)."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    tokens: list[TokenEvent] = field(default_factory=list)


@dataclass
class Comment:
    """Not part of the answer: prefill progress or a keep-alive (SSE comments)."""

    text: str


@dataclass
class Loading:
    """First of a stream whose ``model`` must load: it begins now, loading comments follow."""

    model: str


@dataclass
class Usage:
    """Tokens: ``prompt`` includes ``cached`` (read from the prefix cache);
    ``cache_written`` prompt tokens past those were stored in it by this request;
    ``reasoning`` of the ``completion`` tokens carried only thinking."""

    prompt: int
    completion: int
    cached: int
    cache_written: int = 0
    reasoning: int = 0


@dataclass
class Finished:
    """The end: ``reason`` is ``stop`` (end of turn), ``stop_sequence`` (then
    ``stop_sequence`` is the one matched), ``length`` or ``tool_calls``."""

    reason: str
    usage: Usage
    stop_sequence: Optional[str] = None


@dataclass
class ChatResult:
    """A whole answer, collected from the events (non-streamed requests): its ``pieces``
    in order, joined."""

    text: str
    reasoning: str
    tool_calls: list[ToolCall]
    finished: Finished
    tokens: list[TokenEvent]
    pieces: list[Piece]
