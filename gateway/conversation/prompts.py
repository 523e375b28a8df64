"""Turn a validated request into prompt tokens and checkpoint offsets.

Runs in a worker thread (``anyio.to_thread``), never on the engine thread: chat
templates and tokenizers are pure Python/Rust work that must not stall decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from gateway.conversation.checkpoints import (
    MARK_CLOSE, MARK_OPEN, marker_offsets, plan_chat_checkpoints, plan_completion_checkpoints,
)
from gateway.conversation.templates import render_text, tokens_before
from gateway.http.errors import APIError
from gateway.conversation.form import Conversation
from gateway.conversation.segments import encode_chat
from gateway.conversation.tools import ToolPlan, template_messages


@dataclass
class Prompt:
    """A tokenized prompt.

    ``tokens``: prompt token ids; ``checkpoints``: offsets (tokens) where the engine
    saves prefix-cache snapshots; ``opens_reasoning``: the template already opened a
    think block, so generation starts inside reasoning; ``messages`` and
    ``template_kwargs``: what a chat prompt was rendered from (for the next turn).
    """

    tokens: list[int]
    checkpoints: list[int] = field(default_factory=list)
    opens_reasoning: bool = False
    messages: Optional[list[dict]] = field(default=None, repr=False)  # the template messages (chat only)
    template_kwargs: dict = field(default_factory=dict, repr=False)
    breakpoints: dict[int, float] = field(default_factory=dict)  # cache breakpoint offset -> seconds to keep
    applied_edits: list[dict] = field(default_factory=list)  # context edits that changed the conversation
    images: list = field(default_factory=list)  # gateway.models.vision_images.ImageInput of its image positions


def render_chat(tokenizer, conv: Conversation, default_template_kwargs: dict, checkpoint_every: int,
                tools: Optional[ToolPlan] = None, trimmable: bool = False) -> Prompt:
    """Apply the chat template (with ``tools`` as :mod:`gateway.conversation.tools` renders them),
    tokenize, and plan the prompt's checkpoints (:mod:`gateway.conversation.checkpoints`). A model whose
    cache can be trimmed (``trimmable``) needs only the system end and the periodic ones of
    long prompts: the prompt + completion snapshot saved when a request ends serves every
    shorter prefix.

    The template renders text, which is tokenized without special tokens added, the
    way ``apply_chat_template(tokenize=True)`` does (its pieces between special tokens
    that were tokenized recently are not tokenized again, :mod:`gateway.conversation.segments`); the token offsets of the text let
    the checkpoint planner place its offsets without tokenizing again.

    A system turn past the first (Claude Code's, inside its messages; a Responses
    ``developer`` item) is rendered where it stands when the template shows it there, and
    otherwise folded into the user turn before it (:func:`fold_system`), the nearest form
    a template that alternates user and assistant accepts (Gemma 3's raises).

    A conversation whose last turn is an assistant's to continue (``continue_final``, a
    prefill) is rendered without the generation prompt and cut right after that turn's
    text, as ``continue_final_message`` does in Hugging Face's templates. Cache
    breakpoints (``Turn.breaks``) become checkpoints at exactly their token boundary
    (:attr:`Prompt.breakpoints`), found by rendering the conversation with markers there.

    Raises:
        APIError: 400 when the template rejects the conversation.
    """
    if not getattr(tokenizer, "has_chat_template", False):
        raise APIError(400, "this model has no chat template; use /v1/completions")
    prefill = conv.continue_final and bool(conv.turns) and conv.turns[-1].role == "assistant" \
        and bool(conv.turns[-1].text)
    messages = template_messages(conv.turns, tools)
    kwargs = {**default_template_kwargs, **conv.template_kwargs}
    if tools is not None and tools.in_template:
        kwargs["tools"] = tools.tools
    if conv.continue_final and not prefill and messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]  # an empty prefill: an ordinary answer
    text = _shown_in_place(tokenizer, messages, not prefill, kwargs)
    folds = text is None and any(m["role"] == "system" for m in messages[1:])
    if folds:
        messages = fold_system(messages)
    try:
        if text is None:
            text = render_text(tokenizer, messages, not prefill, kwargs)
        if prefill:
            text = _continued(text, messages[-1]["content"])
    except APIError:
        raise
    except Exception as e:  # jinja's raise_exception, bad kwargs, ...
        raise APIError(400, f"the chat template rejected the conversation: {e}", param="messages")
    tokens, ends = encode_chat(tokenizer, text)
    if not tokens:
        raise APIError(400, "the rendered prompt is empty", param="messages")
    if prefill:
        checkpoints = plan_completion_checkpoints(tokens, interval=checkpoint_every)
    else:
        checkpoints = plan_chat_checkpoints(tokenizer, messages, tokens, kwargs, interval=checkpoint_every,
                                            prompt_text=text, token_ends=ends, boundaries=not trimmable,
                                            trimmable=trimmable)
    breakpoints = _breakpoints(tokenizer, conv, tools, kwargs, not prefill, text, tokens, ends, folds)
    checkpoints = sorted(set(checkpoints) | set(breakpoints))
    return Prompt(tokens, checkpoints, _opens_reasoning(tokenizer, tokens), None if prefill else messages, kwargs,
                  breakpoints)


def _shown_in_place(tokenizer, messages: list[dict], generation_prompt: bool, kwargs: dict) -> Optional[str]:
    """The rendered text when ``messages`` has system messages past the first and the
    template shows each where it stands; None otherwise (none to check, or the template
    raises on them or leaves their text out: they must be folded, :func:`fold_system`)."""
    later = [m["content"] for m in messages[1:] if m["role"] == "system"]
    if not later or not _has_system_turns(tokenizer, getattr(tokenizer, "chat_template", None)):
        return None
    try:
        text = render_text(tokenizer, messages, generation_prompt, kwargs)
    except Exception:
        return None
    return text if all(content in text for content in later) else None


_PROBE = ("\u2983s\u2984", "\u2983u\u2984")


_SYSTEM_TURNS: dict[str, bool] = {}  # chat template -> whether it gives system messages turns of their own


def _has_system_turns(tokenizer, template: Optional[str]) -> bool:
    """Whether the template gives a system message a turn of its own (found once per
    template, by rendering a system and a user message); one that folds its system prompt
    into the first user turn (Gemma 3's) has no system role, so later system messages are
    folded too (a template may show a role it was never trained on)."""
    key = template or ""
    if key not in _SYSTEM_TURNS:
        try:
            text = render_text(tokenizer, [{"role": "system", "content": _PROBE[0]},
                                           {"role": "user", "content": _PROBE[1]}], True, {})
            between = text[text.index(_PROBE[0]) + len(_PROBE[0]): text.index(_PROBE[1])]
            _SYSTEM_TURNS[key] = bool(between.strip())
        except Exception:
            _SYSTEM_TURNS[key] = False
    return _SYSTEM_TURNS[key]


def fold_system(messages: list[dict]) -> list[dict]:
    """``messages`` with every system message past the first appended to the last user
    message before it (a blank line between), or, with no user message before it, put
    before the text of the user message after it; a copy. Where a message is folded
    depends only on what came before it, which a conversation never changes: a later
    request renders its earlier turns the same way, so the prefix cache serves them
    (Claude Code's environment block comes after the first user message of each turn)."""
    out: list[dict] = []
    pending: list[str] = []
    for i, m in enumerate(messages):
        m = dict(m)
        if m["role"] == "system" and i > 0:
            before = next((u for u in reversed(out) if u["role"] == "user"), None)
            if before is not None:
                before["content"] = f"{before['content']}\n\n{m['content']}"
            else:
                pending.append(m["content"])
            continue
        if pending and m["role"] == "user":
            m["content"] = "\n\n".join(pending + [m["content"]])
            pending = []
        out.append(m)
    if pending:
        out.append({"role": "user", "content": "\n\n".join(pending)})
    return out


def _continued(text: str, content: str) -> str:
    """``text`` (rendered without the generation prompt) cut right after the last
    assistant message's ``content``: the answer continues it.

    Raises:
        APIError: 400 when the template does not show the content as it is.
    """
    i = text.rfind(content)
    if i < 0:
        raise APIError(400, "the chat template does not show the last assistant message as given, so it "
                       "cannot be continued", param="messages")
    return text[: i + len(content)]


def _breakpoints(tokenizer, conv: Conversation, tools: Optional[ToolPlan], kwargs: dict, generation_prompt: bool,
                 text: str, tokens: list[int], ends, folds: bool) -> dict[int, float]:
    """Token offsets of the conversation's cache breakpoints, with the seconds each is to
    be kept: the conversation is rendered again with a marker at each, and the markers'
    places in the prompt's text become token boundaries. A breakpoint the template does
    not show in place (it rewrites that text) is left out."""
    if not any(t.breaks for t in conv.turns):
        return {}
    marked, ttls = [], {}
    for t in conv.turns:
        body = t.text
        for pos, ttl in sorted(t.breaks, reverse=True):  # from the end, so offsets stay valid
            name = f"b{len(ttls)}"
            ttls[name] = ttl
            body = body[:pos] + f"{MARK_OPEN}{name}{MARK_CLOSE}" + body[pos:]
        marked.append(replace(t, text=body))
    messages = template_messages(marked, tools)
    try:
        marked_text = render_text(tokenizer, fold_system(messages) if folds else messages, generation_prompt, kwargs)
    except Exception:
        return {}
    out: dict[int, float] = {}
    for name, chars in marker_offsets(text, marked_text).items():
        if name in ttls:
            at = tokens_before(tokenizer, text, tokens, ends, chars)
            if 0 < at <= len(tokens):
                out[at] = max(out.get(at, 0.0), ttls[name])
    return out


def render_completion(tokenizer, text: str | list[int], checkpoint_every: int) -> Prompt:
    """Tokenize a completions prompt (a string, or token ids as they are).

    Raises:
        APIError: 400 for token ids outside the vocabulary or an empty prompt.
    """
    if isinstance(text, str):
        tokens = list(tokenizer.encode(text))
    else:
        tokens = list(text)
        vocab = len(tokenizer)
        if any(t >= vocab for t in tokens):
            raise APIError(400, f"token ids must be below the vocabulary size {vocab}", param="prompt")
    if not tokens:
        raise APIError(400, "the prompt is empty", param="prompt")
    return Prompt(tokens, plan_completion_checkpoints(tokens, interval=checkpoint_every))


def after_context(tokenizer, context: list[int], prompt: Prompt) -> Prompt:
    """``prompt`` continuing ``context``, the token ids an earlier answer returned (its
    prompt and answer: Ollama's ``/api/generate`` ``context``): the context, then the
    prompt's tokens without a leading BOS, its checkpoints shifted, so that the prefix cache
    serves everything the earlier request evaluated. The messages go (a next turn would not
    render the context).

    Raises:
        APIError: 400 for a context token outside the vocabulary.
    """
    vocab = len(tokenizer)
    if any(not 0 <= t < vocab for t in context):
        raise APIError(400, f"context: token ids must be in [0, {vocab})", param="context")
    tokens = list(prompt.tokens)
    bos = getattr(tokenizer, "bos_token_id", None)
    if tokens and bos is not None and tokens[0] == bos:
        tokens = tokens[1:]
    shift = len(context) + len(tokens) - len(prompt.tokens)
    return replace(prompt, tokens=list(context) + tokens, messages=None,
                   checkpoints=sorted({c + shift for c in prompt.checkpoints if c + shift > 0}))


def _opens_reasoning(tokenizer, tokens: list[int]) -> bool:
    start: Optional[str] = getattr(tokenizer, "think_start", None)
    if not start:
        return False
    tail = tokenizer.decode(tokens[-8:])
    return tail.rstrip().endswith(start)
