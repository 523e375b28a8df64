"""The CPU code paths of a model that loads, each chosen by a short measurement
(:mod:`gateway.cpu.measure`): the attention kernels for its shapes
(:mod:`gateway.cpu.attention`), then, for the first model of the process, the allocator
setting (:mod:`gateway.cpu.allocator`) on a prefill-shaped workload of that model with
those kernels, and the streams a decode batch's merge of row caches spreads over
(:mod:`gateway.cpu.merges`). Its weights' dtype is chosen before, as they are read
(:func:`gateway.cpu.weights.float32_weights_for_cpu_backend`), and the BLAS at start-up
(:mod:`gateway.cpu.blas`).
"""

from __future__ import annotations

import time

import mlx.core as mx

from gateway.cpu import allocator, attention, cpu_backend, merges
from gateway.cpu.measure import Choice

WORKLOAD_TOKENS = (384, 1536)  # (queries, keys) of the allocator's prefill-shaped workload


def prefill_workload(model, shapes: set[tuple]):
    """A call doing prefill-shaped work of ``model`` on the CPU: attention of its first
    float32 shape over :data:`WORKLOAD_TOKENS` with a causal mask (through the planned
    kernel) and an MLP-sized matmul pair on those queries; what it returns goes to
    ``mx.eval``. None when the model has no float32 attention."""
    shapes = sorted(s for s in shapes if s[3] == mx.float32)
    if not shapes:
        return None
    hq, hk, d, _ = shapes[0]
    args = getattr(model, "args", None)
    hidden = int(getattr(args, "hidden_size", 0) or hq * d)
    inter = int(getattr(args, "intermediate_size", 0) or 4 * hidden)
    tq, tk = WORKLOAD_TOKENS
    keys = mx.random.split(mx.random.key(2), 5)
    q, k, v = (mx.random.normal(s, key=kk) for s, kk in
               zip(((1, hq, tq, d), (1, hk, tk, d), (1, hk, tk, d)), keys[:3]))
    x = mx.random.normal((tq, hidden), key=keys[3])
    w1, w2 = mx.random.normal((hidden, inter), key=keys[4]) * 0.02, mx.random.normal((inter, hidden)) * 0.02
    mask = (mx.arange(tk - tq, tk)[:, None] >= mx.arange(tk)[None])[None, None]
    mx.eval(q, k, v, x, w1, w2, mask)

    def work():
        h = x @ w1
        return [attention.attention(q, k, v, scale=d ** -0.5, mask=mask), (h * mx.sigmoid(h)) @ w2]

    return work


def choose_cpu_paths(model, rounds: int = 4, measure: bool = True) -> list[Choice]:
    """Measure and set the attention kernels for ``model``'s shapes and (once per
    process) the allocator setting; returns the choices (each is logged), the last one
    a note of the seconds the measurements took. The measurements run on a stream of the
    calling thread's own (a model loads while the engine loop steps the others).

    ``measure`` false keeps MLX's own paths unmeasured: for a model split across ranks
    (``mlx.launch``), where a rank that finished measuring waits in the next collective
    while the others still measure, and on shared cores that wait takes the CPU the
    others' measurements need (their timings, and the load, then ran 7x longer)."""
    if not measure:
        return [Choice("CPU paths", "MLX's own", reason="split across ranks: not measured, every rank alike").log()]
    stream = mx.new_stream(mx.default_device())
    try:
        with mx.stream(stream):
            return _choose(model, rounds)
    finally:
        mx.synchronize(stream)


def _choose(model, rounds: int) -> list[Choice]:
    tic = time.perf_counter()
    allocator.as_it_will_serve()  # the kernels timed with the heap as it will serve
    choices = attention.choose_for_model(model, rounds)
    if allocator.unavailable() is None and allocator.decided() is None:
        workload = prefill_workload(model, attention.attention_shapes(model))
        if workload is not None:
            choices.append(allocator.choose(workload, mx.eval, max(1, rounds - 2)))
    if cpu_backend() and merges.decided() is None:
        choices.append(merges.choose(model, attention.attention_shapes(model), max(1, rounds - 1)))
    choices.append(Choice("CPU path measurements", "done", reason=f"{time.perf_counter() - tic:.2f} s").log())
    return choices
