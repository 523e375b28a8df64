"""Where a suffix prefill's time goes on this backend: prints figures, asserts nothing.

A warm turn prefills only its new tokens, but each of them attends over the whole cached
prefix, so at a few thousand tokens of context attention dominates even a small model.
This script times, on the serving benchmark's model (``bench_serve.py``'s 4-layer qwen3):

* a prefill of ``n`` new tokens after ``context`` cached ones (the model call, with and
  without the last position's logits);
* one layer's attention (``mx.fast.scaled_dot_product_attention``, causal) at that shape,
  and its parts: ``q @ k^T``, ``softmax``, ``exp`` alone, ``p @ v``;
* ``exp`` over the same number of elements in NumPy, for scale.

On Linux ``mlx[cpu]`` the ``exp`` inside the softmax is the bulk of a warm suffix's
prefill; mlx_lm.server runs the same kernels, so neither server can beat the other on
that time by scheduling. Preload the system OpenBLAS (``gateway/cpu/blas.py``).

Usage::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/bench_prefill_ops.py [--model DIR] [--context 2000] [--new 90]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scenarios import medium_model, timed  # noqa: E402


def best_ms(fn, reps: int = 7) -> float:
    """Fastest of ``reps`` runs of ``fn`` after one warm-up (milliseconds)."""
    return 1e3 * timed(fn, reps, warmup=True, stat=min)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: bench_serve's 4-layer qwen3)")
    ap.add_argument("--context", type=int, default=2000, help="cached tokens (default %(default)s)")
    ap.add_argument("--new", type=int, default=90, help="new tokens prefilled (default %(default)s)")
    args = ap.parse_args()
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache


    model, _ = load(args.model or medium_model())
    ctx, n = args.context, args.new
    cache = make_prompt_cache(model)
    model(mx.array([[5] * ctx]), cache=cache)
    mx.eval([c.state for c in cache])

    def prefill(logits: bool):
        for c in cache:
            c.trim(c.offset - ctx)
        out = model(mx.array([[7] * n]), cache=cache)
        mx.eval(out[:, -1] if logits else [c.state for c in cache])

    args_ = model.args
    heads, kv_heads = args_.num_attention_heads, args_.num_key_value_heads
    head_dim = getattr(args_, "head_dim", None) or args_.hidden_size // heads
    layers = args_.num_hidden_layers
    q = mx.random.normal((1, heads, n, head_dim))
    k = mx.random.normal((1, kv_heads, ctx + n, head_dim))
    v = mx.random.normal((1, kv_heads, ctx + n, head_dim))
    group = heads // kv_heads
    qg = q.reshape(1, kv_heads, group, n, head_dim)
    scores = qg @ mx.expand_dims(k, 2).swapaxes(-1, -2)
    probs = mx.softmax(scores, axis=-1)
    mx.eval(q, k, v, scores, probs)
    elements = scores.size
    np_scores = np.array(scores)

    rows = [
        (f"prefill {n} tokens after {ctx} (cache only)", best_ms(lambda: prefill(False))),
        (f"prefill {n} tokens after {ctx} (+ last logits)", best_ms(lambda: prefill(True))),
        ("attention, one layer (fast sdpa, causal)",
         best_ms(lambda: mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=head_dim ** -0.5, mask="causal")))),
        ("  q @ k^T", best_ms(lambda: mx.eval(qg @ mx.expand_dims(k, 2).swapaxes(-1, -2)))),
        ("  softmax", best_ms(lambda: mx.eval(mx.softmax(scores, axis=-1)))),
        (f"  exp alone ({elements / 1e6:.2f} M elements)", best_ms(lambda: mx.eval(mx.exp(scores)))),
        ("  p @ v", best_ms(lambda: mx.eval(probs @ mx.expand_dims(v, 2)))),
        ("numpy exp, same elements", best_ms(lambda: np.exp(np_scores))),
    ]
    print(f"model: {layers} layers, {heads} heads ({kv_heads} KV), head_dim {head_dim}; mlx {mx.__version__}")
    for name, ms in rows:
        print(f"{name:50s} {ms:8.2f} ms")
    sdpa = rows[2][1]
    print(f"attention x {layers} layers: {layers * sdpa:.1f} ms (timed apart from the prefill); "
          f"mlx exp {elements / rows[5][1] / 1e3:.0f} M/s, numpy exp {elements / rows[7][1] / 1e3:.0f} M/s")


if __name__ == "__main__":
    main()
