"""Turn a validated request into prompt tokens and checkpoint offsets.

Runs in a worker thread (``anyio.to_thread``), never on the engine thread: chat
templates and tokenizers are pure Python/Rust work that must not stall decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from cache.checkpoints import encode_with_ends, plan_chat_checkpoints, plan_completion_checkpoints, render_text
from gateway.http.errors import APIError
from gateway.conversation.form import Conversation
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


def render_chat(
    tokenizer, conv: Conversation, default_template_kwargs: dict, checkpoint_every: int,
    tools: Optional[ToolPlan] = None, trimmable: bool = False,
) -> Prompt:
    """Apply the chat template (with ``tools`` as :mod:`gateway.conversation.tools` renders them),
    tokenize, and plan the prompt's checkpoints (:mod:`cache.checkpoints`). A model whose
    cache can be trimmed (``trimmable``) needs only the system end and the periodic ones of
    long prompts: the prompt + completion snapshot saved when a request ends serves every
    shorter prefix.

    The template renders text, which is tokenized without special tokens added, the
    way ``apply_chat_template(tokenize=True)`` does; the token offsets of the text let
    the checkpoint planner place its offsets without tokenizing again.

    Raises:
        APIError: 400 when the template rejects the conversation.
    """
    if not getattr(tokenizer, "has_chat_template", False):
        raise APIError(400, "this model has no chat template; use /v1/completions")
    messages = template_messages(conv.turns, tools)
    kwargs = {**default_template_kwargs, **conv.template_kwargs}
    if tools is not None and tools.in_template:
        kwargs["tools"] = tools.tools
    try:
        text = render_text(tokenizer, messages, True, kwargs)
    except APIError:
        raise
    except Exception as e:  # jinja's raise_exception, bad kwargs, ...
        raise APIError(400, f"the chat template rejected the conversation: {e}", param="messages")
    tokens, ends = encode_with_ends(tokenizer, text)
    if not tokens:
        raise APIError(400, "the rendered prompt is empty", param="messages")
    checkpoints = plan_chat_checkpoints(tokenizer, messages, tokens, kwargs, interval=checkpoint_every,
                                        prompt_text=text, token_ends=ends, boundaries=not trimmable,
                                        trimmable=trimmable)
    return Prompt(tokens, checkpoints, _opens_reasoning(tokenizer, tokens), messages, kwargs)


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


def _opens_reasoning(tokenizer, tokens: list[int]) -> bool:
    start: Optional[str] = getattr(tokenizer, "think_start", None)
    if not start:
        return False
    tail = tokenizer.decode(tokens[-8:])
    return tail.rstrip().endswith(start)
