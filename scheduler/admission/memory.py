"""Admission by predicted memory: a request joins the batch only when what it can grow to
fits beside what the running rows may grow to.

A row's reservation is the KV of its prompt plus a *grant* of new tokens, not its whole
``max_tokens`` (the gateway cuts ``max_tokens`` to the context's end, so a request without
one would reserve the whole context and, under a tight budget, run alone): the grant is
``min(max_tokens, QUANTUM)``, and the engine grows it by another ``QUANTUM`` before the
row's tokens pass it (:mod:`scheduler.admission.preemption`, vLLM's growth of a sequence's
blocks). ``QUANTUM`` is ``BATCH_STEP``, 256 tokens: mlx-lm's ``KVCache.step``, what a batch
cache grows by at once anyway, so a smaller grant would not hold less memory and a larger
one would hold memory a short answer never uses. A reservation also counts speculative
headroom (``K`` draft tokens), the padding of a batch (one step's worth of cache growth,
``BATCH_STEP``), and the step's transient memory: a prefill chunk's activations (for the
chunk's own tokens, at most ``--prefill-step-size``), its attention scores where they are
materialized (the CPU backend: ``heads x chunk x context`` scores, :data:`SCORE_BYTES`
each, and the block kernel's copy of a layer's values, per row), and each row's logits
and log-probabilities at the positions it samples (``vocab`` float32 each, times ``1 + K``
with speculation; a chunk computes logits only where it samples), with speculation the
holes rejected drafts leave, a decode or verify step's scores, and one copy of the batch's
largest layer (:meth:`MemoryGate.held`). The room is what the memory budget leaves after
every model's weights (``room()``, set by the gateway's model registry); the prefix cache
shares it.
``MLX_GATEWAY_RESERVATION_QUANTUM=0`` in the environment reserves every row's whole
``max_tokens`` at admission instead (no growth, no preemption: the behaviour before
growth, for comparisons such as ``benchmarks/bench_memory_burst.py``).

The order of giving way, for a request that does not fit:

1. the prefix cache: least recently used unleased snapshots are dropped (eviction reason
   ``memory``) until it fits or only leased ones are left;
2. the request waits (the waiting queue is bounded by ``--max-waiting``; over it the
   submit answers 503 with ``Retry-After``), and is admitted when running rows end;
3. a request that could not fit even with no row running and an empty cache is refused
   at once (503, the gateway adds ``Retry-After``): it never starts and fails halfway.

A row whose grant cannot grow (the same order: the cache gives way first) preempts a
row, the latest arrived of the lowest class (it may be itself): that row's KV goes into
the prefix cache and its request back to the head of the waiting queue, to go on where
it stopped (:mod:`scheduler.admission.preemption`). A row alone that cannot grow even
with an empty cache ends with ``finish_reason: length``.

Per-token bytes come from the model's layer
caches (:func:`kv_bytes_per_token`): full attention layers cost ``2 H D`` elements per token
(``--kv-bits`` packs them, with scales and biases per group), sliding-window layers stop
at their window, recurrent layers hold a fixed state that is not counted (it does not
grow with the context).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from scheduler.batch_merge import merge_streams
from scheduler.speculative.holes import COMPACT_FRACTION, COMPACT_MIN

BATCH_STEP = 256  # tokens a batch cache grows by at once (mlx-lm KVCache.step): a row's padding headroom
QUANTUM = BATCH_STEP  # new tokens a reservation is granted at once (see the module docstring)
ACTIVATION_COPIES = 8  # hidden-size float32 vectors per chunk token alive at once in a layer (a bound)
SCORE_BYTES = 10  # per attention score at once: 2.5 float32 arrays (the CPU kernels, 2.25-2.34 measured; MLX's own 1)
BLOCK_QUERIES = 16  # queries a row past which the CPU takes its block kernel, which copies a layer's values (gateway.cpu.attention.FEW_QUERIES)


@dataclass(frozen=True)
class KVShape:
    """A model's KV growth: ``per_token`` bytes per token of its growing layers, for each
    sliding-window layer ``(bytes per token, window tokens)``, and ``layer``, the bytes per
    token of its largest growing layer (0: one layer is ``per_token``)."""

    per_token: int
    windows: tuple[tuple[int, int], ...] = ()
    layer: int = 0

    def bytes_for(self, tokens: int, chunk: int = 0) -> int:
        """KV bytes of one row holding ``tokens`` tokens; a window layer holds up to its
        window plus the ``chunk`` tokens a prefill step adds before it rotates."""
        return self.per_token * tokens + sum(b * min(tokens, w + chunk) for b, w in self.windows)

    def layer_bytes(self, tokens: int) -> int:
        """KV bytes of one row's largest layer holding ``tokens`` tokens (a window layer at
        most its window)."""
        return max([(self.layer or self.per_token) * tokens] + [b * min(tokens, w) for b, w in self.windows])


def _args(model: Any) -> Callable[..., Any]:
    """``get(name, default=None)`` over the model's args (``args`` or ``config``, a dict or
    an object); a vision-language model's ``text_config`` where the top level has no
    attention fields."""
    args = getattr(model, "args", None) or getattr(model, "config", None)
    text = getattr(args, "text_config", None)
    args = text if text is not None and not hasattr(args, "num_key_value_heads") else args

    def get(name: str, default: Any = None) -> Any:
        if isinstance(args, dict):
            return args.get(name, default)
        return getattr(args, name, default)

    return get


def _attention_dims(model: Any) -> tuple[int, int, int]:
    """(kv heads, head dim, element bytes) of the model's attention, from its args."""
    get = _args(model)
    heads = get("num_attention_heads") or get("n_heads") or 1
    kv_heads = get("num_key_value_heads") or heads
    head_dim = get("head_dim") or (get("hidden_size") or 0) // max(1, heads)
    try:
        import mlx.core as mx
        from mlx.utils import tree_flatten

        dtype = next((v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)),
                     mx.float16)
        size = dtype.size
    except Exception:
        size = 2
    return int(kv_heads), int(head_dim), int(size)


def kv_bytes_per_token(model: Any, caches: Iterable[Any]) -> KVShape:
    """The :class:`KVShape` of ``model`` whose fresh layer caches are ``caches``
    (``make_prompt_cache(model)``): per layer, ``2 H D`` elements per token of the model's
    float size, or with ``bits`` (``--kv-bits``) ``2 H (D bits / 8 + 2 (D / group) s)``
    (``cache/quantized.py``); a ``max_size`` (sliding window) caps a layer's tokens;
    recurrent layers (no ``keys``) count nothing."""
    kv_heads, head_dim, size = _attention_dims(model)
    per_token, windows, largest = 0, [], 0
    for c in caches:
        name = type(c).__name__
        if not hasattr(c, "keys") or "Arrays" in name or "Mamba" in name:
            continue
        bits = getattr(c, "bits", None)
        if bits:
            group = getattr(c, "group_size", 64) or 64
            b = 2 * kv_heads * (head_dim * bits // 8 + 2 * (head_dim // group) * size)
        else:
            b = 2 * kv_heads * head_dim * size
        window = getattr(c, "max_size", None)
        if window:
            windows.append((b, int(window)))
        else:
            per_token, largest = per_token + b, max(largest, b)
    return KVShape(per_token, tuple(windows), largest)


class MemoryGate:
    """Reservations of one model's rows (the engine thread's; see the module docstring).

    Args:
        shape: the model's :class:`KVShape`.
        hidden: the model's hidden size; ``vocab``: its logits' width.
        chunk: prefill chunk tokens (``--prefill-step-size``).
        draft: speculative draft tokens per step (0: none).
        heads: attention heads; ``scores``: attention materializes its scores (CPU:
            ``[heads, chunk, context]`` of them per prefill chunk, :data:`SCORE_BYTES` each;
            Metal's fused attention does not, and ``scores`` is False there).
        quantum: new tokens a row's reservation is granted at once (0: its whole ``max_tokens``).
    """

    def __init__(self, shape: KVShape, hidden: int, vocab: int, chunk: int, draft: int = 0, heads: int = 0,
                 scores: bool = False, quantum: int = QUANTUM):
        self.shape, self.chunk, self.draft = shape, chunk, draft
        self.heads = heads if scores else 0
        self.activation = hidden * 4 * ACTIVATION_COPIES  # bytes of a prefilled token's activations (float32)
        self.transient = chunk * self.activation  # the most one prefill chunk's activations take
        self.logits = vocab * 4 * 2 * (1 + draft)  # a row's sampled positions: float32 logits and log-probabilities
        self.room: Optional[Callable[[], Optional[int]]] = None  # bytes for KV and cache; None: no gate
        self.quantum = quantum  # new tokens a reservation grows by (0: whole max_tokens, no growth)

    def context(self, tokens: int) -> int:
        """Positions a batch row holding ``tokens`` tokens may take: its growth step
        (``BATCH_STEP``) and, with speculation, its draft and the holes rejected drafts
        leave until the batch compacts them (:mod:`scheduler.speculative.holes`: at
        ``COMPACT_FRACTION`` of the batch's positions, at least ``COMPACT_MIN``)."""
        context = tokens + BATCH_STEP
        if self.draft:
            context += self.draft + max(COMPACT_MIN, math.ceil(COMPACT_FRACTION * context))
        return context

    def need(self, prompt_tokens: int, max_tokens: int) -> int:
        """Bytes a row of ``prompt_tokens`` holds with ``max_tokens`` generated (its grant:
        KV with its padding and holes, logits)."""
        return self.shape.bytes_for(self.context(prompt_tokens + max_tokens), self.chunk) + self.logits

    def held(self, rows: list[tuple[int, int, int]]) -> int:
        """Bytes a batch of ``rows`` holds, each ``(prompt tokens, new tokens granted, bytes of
        its prefill chunk or 0)``: mlx-lm's batch caches are left-padded to their longest row
        (``[B, H, T, D]``), so every row holds the KV of the longest context of the batch
        (:meth:`need` of it), and a prefilling row its chunk's memory besides. A batch also
        copies its layer caches, one layer after another: a cache that grows (mlx-lm's
        ``BatchKVCache`` concatenates a larger buffer), rows that leave (a gather of the
        others) or join (:func:`scheduler.batch_merge.extend_with_rows`, ``merge_streams()``
        layers at once), holes squeezed out: the old buffer lives until its copy is made,
        so the batch holds one copy of that many layers more (:meth:`KVShape.layer_bytes`).
        A decoding row's step (``1 + K`` positions, a plain one 1) materializes its attention
        scores where a prefill chunk does (:meth:`scores` over the context); a row
        prefilling takes no verify step (the batch's steps stay plain)."""
        if not rows:
            return 0
        longest = max(p + n for p, n, _ in rows)
        context = self.context(longest)
        copy = self.shape.layer_bytes(context) * merge_streams()
        verify = self.scores(1 + self.draft, context)
        return len(rows) * (self.need(longest, 0) + copy) + sum(max(b, verify) for _, _, b in rows)

    def prefill_need(self, prompt_tokens: int, cached: int = 0) -> int:
        """Bytes a row's prefill chunk needs while it prefills: its activations (a chunk of
        at most ``chunk`` tokens, and no more than the ``prompt_tokens - cached`` it
        prefills) and, where they are materialized, its attention scores (:meth:`scores`),
        with the copy of a layer's values that the CPU's block kernel makes for a chunk of
        more than :data:`BLOCK_QUERIES` queries (``[v, 1]``: a column of ones appended,
        ``gateway.cpu.attention_kernels``; bounded by half the layer's KV and 1/32 more, for
        heads of at least 16 dimensions)."""
        tokens = max(1, min(self.chunk, prompt_tokens - cached))
        values = 0
        if self.heads and tokens > BLOCK_QUERIES:
            layer = self.shape.layer_bytes(prompt_tokens)
            values = layer // 2 + layer // 32
        return tokens * self.activation + self.scores(tokens, prompt_tokens) + values

    def scores(self, queries: int, keys: int) -> int:
        """Bytes of one row's attention scores in a layer where they are materialized (0
        elsewhere): ``heads x queries x keys`` scores, :data:`SCORE_BYTES` each. Measured with
        ``mx.get_peak_memory`` around one call: MLX's own attention holds one float32 array
        of them, the gateway's compiled CPU kernels 2.25-2.34 (the scores, their exponentials
        and a byte of exponent per score; ``gateway.cpu.attention_kernels``;
        ``tests/test_memory_admission.py`` checks the bound)."""
        return self.heads * queries * keys * SCORE_BYTES

    def fit_cache(self, held: int, cache: Any) -> None:
        """Drop unleased snapshots of ``cache`` (least recently used first) until it fits
        beside ``held`` reserved bytes: finished and preempted rows store their KV there
        between two admissions, and nothing else bounds it by the room."""
        room = self.room() if self.room is not None else None
        while room is not None and held + cache.nbytes > room and cache.eviction.evict_oldest("memory"):
            pass

    def first_grant(self, max_tokens: int, grows: bool) -> int:
        """New tokens a row is first reserved for: ``min(max_tokens, quantum)``, or its whole
        ``max_tokens`` when it does not grow (``grows`` False or a quantum of 0)."""
        return min(max_tokens, self.quantum) if grows and self.quantum > 0 else max_tokens

    def decide(self, need: int, held: int, cache: Any, running: bool, alone: Optional[int] = None) -> str:
        """``fits``, ``wait`` or ``never`` for a request needing ``need`` bytes beside
        ``held`` reserved by the running rows, dropping unleased snapshots of ``cache``
        (a ``PromptCacheManager``) first when that makes it fit (and only then: a request that
        cannot fit beside the running rows leaves the cache as it is). ``running``: some row is
        in the batch (its end frees memory). ``alone``: the bytes it needs with no row
        beside it (default ``need``); ``never`` when they exceed the room."""
        room = self.room() if self.room is not None else None
        if room is None:
            return "fits"
        if room - (need if alone is None else alone) < 0:
            return "never"  # not even alone, with an empty cache
        left = room - held - need
        if left < 0:  # no eviction makes it fit beside the running rows: keep the cache
            return "wait" if running or cache.num_leases else "never"
        while cache.nbytes > left and cache.eviction.evict_oldest("memory"):
            pass
        if held + need + cache.nbytes <= room:
            return "fits"
        return "wait" if running or cache.num_leases else "never"


def gate_for(model: Any, caches: Iterable[Any], chunk: int, draft: int = 0) -> MemoryGate:
    """The :class:`MemoryGate` of ``model`` (fresh layer caches ``caches``), sizes from its args.
    Attention scores are counted on the CPU device only (the GPU backends' fused attention
    does not materialize them). The quantum is ``MLX_GATEWAY_RESERVATION_QUANTUM`` (tokens)
    where set, else :data:`QUANTUM`."""
    import os

    import mlx.core as mx

    get = _args(model)
    return MemoryGate(kv_bytes_per_token(model, caches), int(get("hidden_size") or 0), int(get("vocab_size") or 0),
                      chunk, draft, int(get("num_attention_heads") or 0),
                      scores=mx.default_device().type == mx.DeviceType.cpu,
                      quantum=int(os.environ.get("MLX_GATEWAY_RESERVATION_QUANTUM", QUANTUM)))
