"""Quantized KV cache (``--kv-bits 8|4``) against float, in one run; prints figures,
asserts nothing.

Model: ``--model PATH``, else the random-weight model of SmolLM2-135M's shape that
``bench_speculative.py`` builds (llama, 30 layers, 3 KV heads of 64, float32). Each
setting (float, 8 bits, 4 bits; group 64) loads the model afresh and serves from an
engine in process (no HTTP), on the same prompts:

* bytes per cached token: a 1,000-token prompt's snapshot in the prefix cache, over its
  tokens (the figure the prefix cache's byte bound counts), and the ratio to float;
* greedy agreement with float: of ``--prompts`` prompts (fresh words), how many give the
  same first 64 tokens as float, and the mean length of the common prefix;
* speed: prefill tokens/s of a cold 1,500-token prompt, and decode tokens/s at 1 and 4
  streams (from each stream's first token to its last, summed).

On Linux, preload the system OpenBLAS (``gateway/cpu/blas.py``).

Usage::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/bench_kv_quant.py [--model PATH] [--prompts 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_speculative import smol_shaped_model  # noqa: E402
from scenarios import tokenizer, words, write_results  # noqa: E402


class Sink:
    """An engine request's sink: token arrival times and the tokens."""

    def __init__(self):
        self.tokens, self.times, self.done = [], [], threading.Event()

    def __call__(self, events):
        from scheduler.request import DoneEvent, ErrorEvent, TokenEvent

        for e in events:
            if isinstance(e, TokenEvent):
                self.tokens.append(e.token)
                self.times.append(time.monotonic())
            elif isinstance(e, (DoneEvent, ErrorEvent)):
                self.done.set()


def run(engine, prompts: list[list[int]], max_tokens: int) -> list[Sink]:
    from scheduler import EngineRequest, SamplingParams

    sinks = [Sink() for _ in prompts]
    with engine.arrivals.prepare():
        for i, (p, s) in enumerate(zip(prompts, sinks)):
            engine.submit(EngineRequest(f"b{time.monotonic()}-{i}", p, SamplingParams(max_tokens=max_tokens), s))
    for s in sinks:
        s.done.wait(3600)
    return sinks


def setting(model_dir: str, bits, prompts: list[list[int]], long_prompt: list[int]) -> dict:
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    from cache import PromptCacheManager
    from cache.quantized import quantize_kv
    from scheduler import Engine

    from gateway.backend import backend

    model, tok = mlx_lm.load(model_dir)
    backend().prepare_weights(model)  # the paths serve would take on this machine
    if bits:
        quantize_kv(model, bits, 64)
    backend().prepare(model)
    manager = PromptCacheManager(8 << 30, 64)
    snap = make_prompt_cache(model)
    model(mx.array([long_prompt[:1000]]), cache=snap)
    mx.eval([c.state for c in snap])
    manager.insert("bytes", long_prompt[:1000], snap)
    per_token = manager.nbytes / 1000
    manager.close()

    engine = Engine(model, set(), PromptCacheManager(8 << 30, 256), prompt_concurrency=8, decode_concurrency=8,
                    gather_wait=30.0)
    engine.start()
    try:
        run(engine, [prompts[0][:20]], 4)  # warm-up
        tic = time.monotonic()
        (s,) = run(engine, [long_prompt], 1)
        prefill = len(long_prompt) / (s.times[0] - tic)
        decode = {}
        for n in (1, 4):
            engine.flush_cache()
            sinks = run(engine, [p + [7 + n] for p in prompts[:n]], 64)
            decode[n] = sum((len(x.times) - 1) / (x.times[-1] - x.times[0]) for x in sinks if len(x.times) > 1)
        engine.flush_cache()
        answers = [s.tokens for s in run(engine, prompts, 64)]
    finally:
        engine.stop()
    return {"bytes_per_token": per_token, "prefill_tok_s": prefill, "decode_1": decode[1], "decode_4": decode[4],
            "answers": answers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="model directory (default: random weights of SmolLM2-135M's shape)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--out", help="directory for kv_quant.json and kv_quant.md")
    args = ap.parse_args()
    model_dir = args.model or smol_shaped_model()
    tok = tokenizer(model_dir)
    prompts = [tok.encode(words(120, 300 + i)) for i in range(max(4, args.prompts))]
    long_prompt = tok.encode(words(1400, 7))[:1500]
    results = {name: setting(model_dir, bits, prompts, long_prompt) for name, bits in
               (("float", None), ("8-bit", 8), ("4-bit", 4))}
    ref = results["float"]["answers"]
    lines = ["| KV cache | bytes/token | vs float | same 64 tokens | mean common prefix | prefill tok/s | "
             "decode tok/s (1) | decode tok/s (4) |", "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        same = sum(a == b for a, b in zip(r["answers"], ref))
        common = statistics.mean(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                                 for a, b in zip(r["answers"], ref))
        r.update(same=same, common=common)
        lines.append(f"| {name} | {r['bytes_per_token']:.0f} | {r['bytes_per_token'] / results['float']['bytes_per_token']:.2f} | "
                     f"{same}/{len(ref)} | {common:.1f} | {r['prefill_tok_s']:.0f} | {r['decode_1']:.1f} | "
                     f"{r['decode_4']:.1f} |")
    md = "\n".join(lines)
    print(md)
    if args.out:
        write_results(args.out, {"kv_quant.json": {k: {n: v for n, v in r.items() if n != "answers"}
                                                   for k, r in results.items()}, "kv_quant.md": md})


if __name__ == "__main__":
    main()
