"""Prefix-cache benchmark (a script, not a test).

Usage:  python benchmarks/bench_cache.py [--lengths 2048 20480] [--new 128] [--model DIR] [--http]

Model (``--model``, default): the tiny random-weight ``qwen3`` test model (2 layers, hidden 64, 2 KV heads
of dim 16, float32, ~1K vocabulary; ``tests/conftest.py``), run on whatever MLX
backend is present. Absolute times are those of a toy model; the point is the ratio
cold / hot and the size of the fetch overhead (lookup, copy, restore).

Reports, per prefix length, through the engine (``scheduler.Engine``, from submit to
the first token of a greedy one-token request):
  - cold TTFT: prefill of the whole prompt, no cache;
  - exact-prefix hot TTFT: the same prompt again (what the engine stored of it restored);
  - nearest-prefix hot TTFT: the stored prompt shares all but its last 128 tokens
    with the query (snapshot trimmed, 128 new tokens run);
  - fetch overhead split into lookup / copy / restore (seconds, the manager's own fetch);
  - the nearest-prefix hit's time split by phase (wall time of the engine's functions,
    exclusive of their callees, timed for that request alone: the restore, the row's
    insertion, the prompt batch's setup, the prefill forward of its new tokens, the join
    into the decode batch, the first decode step, snapshots), beside the forward of its
    new tokens alone on a copy of the restored cache.
A ``--model`` gets the gateway's CPU paths first (its float32 weights and attention, as
``serve`` measures them at load). ``--http``: the same cold / exact / nearest TTFT over HTTP
(``/v1/completions``, text prompts, one token), ``mlx-gateway serve`` and ``mlx_lm.server``
running side by side, taking turns, on one float32 copy of the model (the gateway's
conversion, saved); a nearest prompt is the stored text's first ``n - new`` tokens and new
text, so its retokenized tail is ``new`` tokens give or take a few.
Then: memory (mx.get_active_memory) and time to hand out a copy of a 100K-token
snapshot, for the tiny model's layer shapes and for 4 layers of a Qwen3-0.6B-like
shape (8 KV heads x 128 dims, float16), and the memory of the first write to it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import KVCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cache import PromptCacheManager  # noqa: E402
from scheduler import Engine, EngineRequest, SamplingParams  # noqa: E402
from scheduler.request import PromptEvent  # noqa: E402
from tests.conftest import EventSink, model_path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from phases import Phases  # noqa: E402


def hit_phases() -> Phases:
    """Wall-time timers on the functions a prefix-cache hit runs through (engine thread)."""
    from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch

    from scheduler.batch import Batch
    from scheduler.batch.decode_batch import JoiningGenerationBatch
    from scheduler.batch.generator import JoiningBatchGenerator
    from scheduler.batch.insertion import RowInsertion

    ph = Phases(clock=time.perf_counter)
    ph.wrap(PromptCacheManager, "fetch", "restore (lookup, copy, trim)")
    ph.wrap(RowInsertion, "start_row", "row insertion (segments, sampler)")
    ph.wrap(BatchGenerator, "_make_batch", "prompt batch setup (caches merged)")
    ph.wrap(PromptProcessingBatch, "prompt", "prefill forward of the new tokens")
    ph.wrap(JoiningBatchGenerator, "_join_finished_prompts", "join into the decode batch")
    ph.wrap(JoiningGenerationBatch, "plain_next", "first decode step")
    ph.wrap(GenerationBatch, "extract_cache", "snapshots (extract, store)")
    ph.wrap(Batch, "_save_snapshot", "snapshots (extract, store)")
    ph.wrap(Batch, "step", "scheduling (the rest of the steps)")
    return ph


def forward_alone(model, hit, tokens: list[int]) -> float:
    """Seconds of the forward of ``tokens`` alone over a copy of a fetched prefix (its
    layer caches), evaluated, and its greedy first token."""
    import copy

    cache = copy.deepcopy(hit.cache)
    mx.eval([c.state for c in cache])
    t = time.perf_counter()
    logits = model(mx.array([tokens]), cache=cache)
    mx.eval(mx.argmax(logits[:, -1], axis=-1))
    return time.perf_counter() - t


def prompt_tokens(tok, n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    words = "the cache token prompt server batch request tenant prefix memory apple code".split()
    out: list[int] = []
    while len(out) < n:
        out.extend(tok.encode(" ".join(rng.choice(words) for _ in range(400)), add_special_tokens=False))
    return out[:n]


def first_token(engine: Engine, tokens: list[int], namespace: str) -> tuple[float, int]:
    """Seconds from submit to the end of a greedy one-token request for ``tokens``, and the
    tokens its prompt reused from the prefix cache."""
    sink = EventSink()
    t = time.perf_counter()
    engine.submit(EngineRequest(uuid.uuid4().hex, tokens, SamplingParams(max_tokens=1), sink, namespace=namespace))
    assert sink.done.wait(600), "the request did not finish"
    seconds = time.perf_counter() - t
    return seconds, next(e.cached_tokens for e in sink.events if isinstance(e, PromptEvent))


def bench_ttft(model, tok, n: int, reps: int, new: int = 128) -> None:
    toks = prompt_tokens(tok, n, seed=n)
    query = toks[: n - new] + prompt_tokens(tok, new, seed=n + 1)
    query[n - new] = (toks[n - new] + 1) % 900 + 5  # diverge exactly at n-new

    mgr = PromptCacheManager(max_bytes=8 << 30, max_entries=64)
    engine = Engine(model, tok.eos_token_ids, mgr)
    engine.start()
    cold_runs, hot_runs, near_runs = [], [], []
    splits: list[dict] = []
    ph = hit_phases()
    try:
        for i in range(max(reps, 3)):
            # fresh namespaces per run, each holding only what the cold run stored
            for kind, q, runs in (("exact", toks, hot_runs), ("near", query, near_runs)):
                ns = f"{kind}-{i}"
                cold_runs.append(first_token(engine, toks, ns))
                before = ph.snapshot()["acc"]
                runs.append(first_token(engine, q, ns))
                if kind == "near":
                    splits.append({k: v - before.get(k, 0.0) for k, v in ph.snapshot()["acc"].items()})
        hits = {kind: mgr.fetch(f"{kind}-0", q) for kind, q in (("exact", toks), ("near", query))}
        ph.remove()
        alone = statistics.median(forward_alone(model, hits["near"], query[near_runs[-1][1]:]) for _ in range(3))
        for hit in hits.values():
            mgr.release(hit.lease)
    finally:
        ph.remove()
        engine.stop()
    cold_s = statistics.median(t for t, _ in cold_runs)
    hot_s = statistics.median(t for t, _ in hot_runs)
    near_s = statistics.median(t for t, _ in near_runs)
    hot, near = hot_runs[-1][1], near_runs[-1][1]
    assert near == n - new, near

    def fmt(t):
        return {k: f"{v * 1e3:.3f}ms" for k, v in t.items() if k != "prefill"}

    print(f"prefix {n:>6} tokens: cold TTFT {cold_s:.3f}s | exact hot {hot_s * 1e3:.1f}ms "
          f"(reused {hot}) | nearest hot {near_s * 1e3:.1f}ms (reused {near}, ran {n - near}) | "
          f"nearest ÷ (exact + forward of {n - near} tokens alone, {alone * 1e3:.1f}ms): {near_s / (hot_s + alone):.2f}")
    keys = sorted({k for sp in splits for k in sp}, key=lambda k: -statistics.median(sp.get(k, 0.0) for sp in splits))
    print("    nearest hit by phase (median ms): " + ", ".join(
        f"{k} {statistics.median(sp.get(k, 0.0) for sp in splits) * 1e3:.2f}" for k in keys))
    print(f"    fetch overhead exact:   {fmt(hits['exact'].timings)}")
    print(f"    fetch overhead nearest: {fmt(hits['near'].timings)}")


def snapshot(layers: int, heads: int, dim: int, n: int, dtype) -> list[KVCache]:
    out = []
    for _ in range(layers):
        c = KVCache()
        k = mx.random.normal((1, heads, n, dim)).astype(dtype)
        c.update_and_fetch(k, k)
        mx.eval(c.keys, c.values)
        out.append(c)
    return out


def bench_copy(name: str, layers: int, heads: int, dim: int, dtype, n: int = 100_000) -> None:
    mgr = PromptCacheManager(max_bytes=64 << 30, max_entries=4)
    toks = list(range(n))
    snap = snapshot(layers, heads, dim, n, dtype)
    size = sum(c.nbytes for c in snap)
    mgr.insert("default", toks, snap)
    del snap
    mx.eval(mx.zeros(1))
    base = mx.get_active_memory()
    t = time.perf_counter()
    hit = mgr.fetch("default", toks + [1])  # exact: whole 100K snapshot
    dt = time.perf_counter() - t
    after_copy = mx.get_active_memory() - base
    # first write to the copy (one decode step on every layer)
    t = time.perf_counter()
    for c in hit.cache:
        x = mx.zeros((1, heads, 1, dim), dtype)
        c.update_and_fetch(x, x)
    mx.eval([c.keys for c in hit.cache] + [c.values for c in hit.cache])
    dw = time.perf_counter() - t
    after_write = mx.get_active_memory() - base
    mgr.release(hit.lease)
    print(f"100K-token snapshot, {name}: {size / 2**20:.1f} MiB stored | hand out copy: "
          f"{dt * 1e3:.3f}ms, +{after_copy / 2**20:.2f} MiB active memory "
          f"(lookup {hit.timings['lookup'] * 1e6:.0f}us, copy {hit.timings['copy'] * 1e6:.0f}us, "
          f"restore {hit.timings['restore'] * 1e6:.0f}us) | first write to the copy: {dw * 1e3:.1f}ms, "
          f"+{after_write / 2**20:.1f} MiB (copy-on-write of the buffers)")


def float32_copy(model_dir: str) -> str:
    """A copy of ``model_dir`` with the weights the gateway serves on the CPU (float32,
    dequantized: :func:`gateway.cpu.weights.float32_weights`), for ``mlx_lm.server``."""
    import shutil
    import tempfile

    from mlx_lm.utils import save_config, save_model

    from gateway.cpu.weights import float32_weights

    out = Path(tempfile.mkdtemp(prefix="float32-"))
    model, _, config = mlx_lm.load(model_dir, return_config=True)
    float32_weights(model, limit_bytes=1 << 40)
    save_model(out, model)
    config.pop("quantization", None), config.pop("quantization_config", None)
    save_config(config, out / "config.json")
    for f in Path(model_dir).glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    return str(out)


def bench_http(model_dir: str, lengths: list[int], reps: int, new: int) -> None:
    """Cold / exact / nearest TTFT (seconds to a one-token completion) of the gateway and
    mlx_lm.server on one float32 copy of ``model_dir``, medians of ``reps``, printed."""
    import httpx

    from scenarios import free_port, start, tokenizer, words

    model = float32_copy(model_dir)
    tok = tokenizer(model)
    servers = {}
    for name, cmd in (("gateway", ["-m", "gateway.cli", "serve", "--no-precompute-next-turn"]),
                      ("mlx_lm.server", ["-m", "mlx_lm.server"])):
        port = free_port()
        servers[name] = (start([sys.executable, *cmd, "--model", model, "--port", str(port)], port)[0],
                         f"http://127.0.0.1:{port}")

    def text(n: int, seed: int) -> str:
        return tok.decode(tok.encode(words(n, seed), add_special_tokens=False)[:n])

    def ttft(url: str, prompt: str) -> float:
        t = time.perf_counter()
        r = httpx.post(url + "/v1/completions", timeout=3600, json={
            "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
        r.raise_for_status()
        return time.perf_counter() - t

    rows = ["| prefix tokens | server | cold TTFT ms | exact repeat ms | nearest hit ms (new tokens) |",
            "|---|---|---|---|---|"]
    try:
        for n in lengths:
            runs: dict = {name: [] for name in servers}
            for i in range(reps):
                for name in (list(servers) if i % 2 == 0 else list(servers)[::-1]):
                    url = servers[name][1]
                    base = text(n, seed=1000 * n + 10 * i + len(runs[name]))
                    head = tok.decode(tok.encode(base, add_special_tokens=False)[: n - new])
                    near = head + " " + text(new, seed=i + 7)
                    ran = len(tok.encode(near, add_special_tokens=False)) - len(tok.encode(head, add_special_tokens=False))
                    runs[name].append((ttft(url, base), ttft(url, base), ttft(url, near), ran))
            for name, rs in runs.items():
                med = [statistics.median(r[k] for r in rs) for k in range(3)]
                rows.append(f"| {n} | {name} | {med[0] * 1e3:.0f} | {med[1] * 1e3:.0f} | {med[2] * 1e3:.0f} "
                            f"({min(r[3] for r in rs)}-{max(r[3] for r in rs)}) |")
            print("\n".join(rows[-len(runs):]), flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(60)
    print("\n".join(rows))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="*", default=[2048, 20480])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new", type=int, default=128, help="tokens a nearest-prefix hit leaves to compute")
    ap.add_argument("--model", help="model directory (default: the tiny qwen3 test model)")
    ap.add_argument("--http", action="store_true", help="over HTTP, beside mlx_lm.server (needs --model)")
    args = ap.parse_args()
    print(f"mlx {mx.__version__}, device {mx.default_device()}")
    if args.http:
        return bench_http(args.model, args.lengths, args.reps, args.new)
    model, tok = mlx_lm.load(args.model or str(model_path("qwen3")))
    if args.model:
        from gateway.backend import backend

        backend().prepare_weights(model)
        backend().prepare(model)
    for n in args.lengths:
        bench_ttft(model, tok, n, reps=args.reps if n <= 4096 else 1, new=args.new)
    bench_copy("tiny qwen3 (2 layers x 2 KV heads x 16, fp32)", 2, 2, 16, mx.float32)
    bench_copy("Qwen3-0.6B-like, 4 of 28 layers (8 KV heads x 128, fp16)", 4, 8, 128, mx.float16)


if __name__ == "__main__":
    main()
