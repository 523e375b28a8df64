"""A request's engine inputs on one model: sampling settings with the model's defaults,
the room its context leaves, the rendered chat (template, tools, output grammar) and the
text assembler of its answer. CPU work only, none of it MLX."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Optional

from gateway.conversation.context_edits import apply_edits, needs_length
from gateway.conversation.form import Conversation, Sampling, Turn
from gateway.conversation.prompts import Prompt, after_context, render_chat, render_completion
from gateway.conversation.structured import CONSTRAINED_THINKING_BUDGET, Thinking, constrains_answer, output_mask
from gateway.conversation.textout import TextAssembler
from gateway.conversation.tools import ToolPlan, plan_tools
from gateway.http.errors import APIError, context_too_long
from gateway.models.handle import ModelHandle
from gateway.tenancy.tenants import Tenant
from scheduler import SamplingParams
from scheduler.grammar import TokenMask
from scheduler.thinking import ThinkingBudget


def sampling_params(model: ModelHandle, tenant: Tenant, s: Sampling) -> SamplingParams:
    """The engine's settings for ``s``, with the model's defaults filled in.

    A request that gives no ``max_tokens`` gets the model's ``max_tokens`` (``--max-tokens``)
    or, without one, the protocol's own default (``s.unset_max_tokens``: 16 on legacy
    completions, as OpenAI's and vLLM's) or else the largest it may ask for: as on OpenAI's
    and vLLM's chat APIs and Ollama's (``num_predict: -1``), it runs until the model stops or
    the context ends (:func:`fit_context` cuts it to the room the prompt leaves).

    Raises:
        APIError: 400 for ``max_tokens`` over the tenant's or the model's limit or a
            ``logit_bias`` token outside the vocabulary.
    """
    spec = model.spec
    limit = min(spec.max_tokens_limit, tenant.max_tokens or spec.max_tokens_limit)
    default = min(spec.max_tokens or s.unset_max_tokens or limit, limit)
    wanted = s.max_tokens if s.max_tokens is not None else default
    if wanted > limit:
        raise APIError(400, f"max_tokens {wanted} is over this key's limit of {limit}", param="max_tokens")
    top_k = s.top_k if s.top_k is not None else spec.top_k
    if top_k >= model.vocab_size:
        top_k = 0  # keeping every token is no filter (and mlx-lm refuses k >= vocabulary)
    bias = s.logit_bias or {}
    for k in bias:
        if int(k) >= model.vocab_size:
            raise APIError(400, f"logit_bias token id {k} is outside the vocabulary (size {model.vocab_size})",
                           param="logit_bias")
    return SamplingParams(max_tokens=wanted, temperature=s.temperature if s.temperature is not None else spec.temp,
                          top_p=s.top_p if s.top_p is not None else spec.top_p, top_k=max(0, top_k),
                          min_p=s.min_p if s.min_p is not None else spec.min_p, seed=s.seed, logprobs=s.logprobs,
                          top_logprobs=s.top_logprobs if s.logprobs else 0,
                          presence_penalty=s.presence_penalty or 0.0, frequency_penalty=s.frequency_penalty or 0.0,
                          repetition_penalty=s.repetition_penalty or 0.0,
                          logit_bias=tuple((int(k), v) for k, v in bias.items()), ignore_eos=s.ignore_eos)


def fit_context(model: ModelHandle, prompt: Prompt, params: SamplingParams) -> SamplingParams:
    """``params`` with ``max_tokens`` cut to the room the context leaves.

    Raises:
        APIError: 400 ``context_length_exceeded`` for a prompt over the model's
            ``max_prompt_tokens`` or its context (in the words clients match:
            :func:`gateway.http.errors.context_too_long`).
    """
    n = len(prompt.tokens)
    cap = model.spec.max_prompt_tokens
    if cap is not None and n > cap:
        raise context_too_long(n, cap)
    if n >= model.context_length:
        raise context_too_long(n, model.context_length)
    room = model.context_length - n
    if params.max_tokens > room:
        params = SamplingParams(**{**params.__dict__, "max_tokens": room})
    return params


def prepare_chat(model: ModelHandle, conv: Conversation, marks: Optional[dict] = None, max_tokens: int = 0,
                 images: Optional[tuple] = None) -> tuple[Prompt, Optional[ToolPlan], Optional[TokenMask], list]:
    """Tools, prompt, output grammar and thinking budget of a conversation. Runs in a
    worker thread: template, tokenizer and grammar compilation are CPU work that must not
    stall the event loop, and none of it touches MLX.

    A thinking model's reasoning is capped by the request's budget, or, before a
    constrained answer, by :data:`CONSTRAINED_THINKING_BUDGET` and an eighth of
    ``max_tokens`` (so the answer still fits).

    ``images``, for a conversation with images: ``(refs, fetched bytes, limits)``, decoded
    here (:func:`gateway.conversation.images.decode_images`) and preprocessed with the
    prompt (:func:`gateway.conversation.vision_prompt.render_vision_chat`).

    A ``raw`` prompt is tokenized as it is (:func:`gateway.conversation.prompts.render_completion`),
    under its output grammar if it has one; a ``context`` goes before the prompt
    (:func:`gateway.conversation.prompts.after_context`).

    Returns:
        ``(prompt, tool plan, token mask, further logits processors)``.

    Raises:
        APIError: 400 for bad tools, schemas or a conversation the template rejects.
    """
    if conv.raw is not None:
        prompt = (render_completion(model.tokenizer, conv.raw, model.spec.checkpoint_every)
                  if conv.raw or not conv.context else Prompt([]))
        mask = output_mask(model.grammars, conv, None) if conv.output_schema is not None else None
        return (after_context(model.tokenizer, conv.context, prompt) if conv.context else prompt), None, mask, []
    if marks is not None:
        marks["render_in"] = time.monotonic()
    plan = plan_tools(conv, model.tokenizer)
    prompt = render_conversation(model, conv, plan, images)
    if conv.context:
        prompt = after_context(model.tokenizer, conv.context, prompt)
    thinking = thinks(model, prompt)
    mask = output_mask(model.grammars, conv, plan, thinking)
    processors = []
    budget = conv.thinking_budget
    if budget is None and constrains_answer(conv, plan):
        budget = min(CONSTRAINED_THINKING_BUDGET, max(4, max_tokens // 8)) if max_tokens else CONSTRAINED_THINKING_BUDGET
    if thinking is not None and budget:
        tags = [model.tokenizer.convert_tokens_to_ids(t) for t in (model.tokenizer.think_start,
                                                                   model.tokenizer.think_end)]
        if all(isinstance(t, int) and t >= 0 for t in tags):
            processors.append(ThinkingBudget(tags[0], tags[1], budget, inside=thinking.opened))
    if marks is not None:
        marks["render_out"] = time.monotonic()
    return prompt, plan, mask, processors


# What warm_up prepares: a system prompt and a question, as the first request of most
# clients looks (a one-turn chat leaves a template's system branch for the first request).
WARM_UP_CHAT = (Turn("system", "You are a helpful assistant. Answer briefly and precisely."),
                Turn("user", "Hello. What can you do for me today?"))


def warm_up(model: ModelHandle) -> bool:
    """Prepare one small chat (:data:`WARM_UP_CHAT`; a user turn alone if the template
    rejects a system turn) as a request would, so that what the first request would do
    once happens at load: compiling the chat template (jinja), the tokenizer's first calls,
    and making the tokenizer's segment encoder with its probes and first check
    (:mod:`gateway.conversation.segments`). Measured on the serving benchmark's model: a
    fresh server's first chat took 8-12 ms to render and tokenize, later ones 2-3 ms.

    Returns:
        True when a chat was prepared; False for a model without a chat template or one
        whose template rejects both chats. Nothing is raised.
    """
    if not getattr(model.tokenizer, "has_chat_template", False):
        return False
    for turns in (WARM_UP_CHAT, WARM_UP_CHAT[1:]):
        try:
            prepare_chat(model, Conversation(list(turns)), max_tokens=16)
            return True
        except Exception:  # an APIError for a template that rejects the chat, or anything else
            continue
    return False


def render_conversation(model: ModelHandle, conv: Conversation, plan: Optional[ToolPlan],
                        images: Optional[tuple] = None) -> Prompt:
    """The prompt of ``conv`` on ``model`` (:func:`render_chat`, or, for a conversation
    with ``images``, :func:`gateway.conversation.vision_prompt.render_vision_chat`), with
    its context edits applied (:mod:`gateway.conversation.context_edits`; the unedited
    prompt's length decides whether they trigger, and :attr:`Prompt.applied_edits` says
    what they did). What ``/v1/messages/count_tokens`` counts too. Worker thread.

    Raises:
        APIError: 400 when the template rejects the conversation or an image is bad.
    """
    spec, tok = model.spec, model.tokenizer
    if images is None:
        def render(c: Conversation) -> Prompt:
            return render_chat(tok, c, spec.chat_template_args, spec.checkpoint_every, plan,
                               trimmable=model.trimmable)
    else:  # the vision stack (mlx-vlm's processors) is an optional extra: imported only when used
        from gateway.conversation.images import decode_images
        from gateway.conversation.vision_prompt import render_vision_chat

        pictures = decode_images(*images)

        def render(c: Conversation) -> Prompt:
            return render_vision_chat(tok, model.vision, c, pictures, spec.chat_template_args,
                                      spec.checkpoint_every, plan)
    if not conv.edits:
        return render(conv)
    unedited = render(conv) if needs_length(conv.edits) else None  # an input-token trigger reads its length
    turns, applied = apply_edits(conv.turns, conv.edits, len(unedited.tokens) if unedited is not None else 0,
                                 lambda text: len(tok.encode(text, add_special_tokens=False)) if text else 0)
    if not applied and unedited is not None:
        return unedited
    prompt = render(replace(conv, turns=turns) if applied else conv)
    prompt.applied_edits = applied
    return prompt


def thinks(model: ModelHandle, prompt: Prompt) -> Optional[Thinking]:
    """Whether the model will think before answering ``prompt``: its template has think
    tags, and the prompt does not end with a closed (empty) block, as templates render
    thinking turned off."""
    tok = model.tokenizer
    if not getattr(tok, "has_thinking", False):
        return None
    tail = tok.decode(prompt.tokens[-8:]).rstrip()
    if tail.endswith(tok.think_end):
        return None
    literal = model.grammars.lark_literal
    return Thinking(literal(tok.think_start), literal(tok.think_end), prompt.opens_reasoning)


def text_assembler(model: ModelHandle, stop: list[str], opens_reasoning: bool, reasoning: bool = True
                   ) -> TextAssembler:
    """A :class:`TextAssembler` for the model's tokenizer (reasoning split when the
    model thinks and ``reasoning`` is true)."""
    tok = model.tokenizer
    think = (tok.think_start, tok.think_end) if reasoning and getattr(tok, "has_thinking", False) else None
    return TextAssembler(tok, stop=list(stop), think=think, in_reasoning=opens_reasoning and think is not None,
                         skip_ids=frozenset(tok.eos_token_ids))
