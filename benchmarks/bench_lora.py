"""LoRA adapters batched together: decode speed of mixed adapters against one adapter and
the base, an adapter's load time and memory, and the decode gap while one loads. Prints
figures (and writes them with ``--out``), asserts nothing.

Model: ``--model PATH`` (``--model default``: the default model, SmolLM2-135M-Instruct's real
weights, 4-bit, as ``mlx-gateway fetch-default-model`` caches them), else the random-weight
model of SmolLM2-135M's shape that ``bench_speculative.py`` builds (llama, 30 layers,
float32). Adapters: random, mlx-lm's
format, as ``mlx_lm.lora``'s defaults make them (rank 8, scale 20, the last 16 layers, every
linear layer of a block). An engine in process (no HTTP) serves each setting:

* decode tokens/s of 4 and 16 streams (64-token prompts of fresh words, 48 tokens each):
  every stream on the base, every stream on one adapter, the streams spread over four
  adapters; tokens after each stream's first, over the time from the first first token to
  the last token; the settings interleaved ``--rounds`` times, the best of each kept;
* the same comparison on the decode forward alone (``step_seconds``: no scheduling), the
  three settings back to back in each of ``--forward-rounds`` rounds: the speed ratios of
  each round (paired: a shared machine's load moves slower than a round) and their median;
* the time to load one adapter: reading its files (numpy, off the engine thread, as the
  gateway does) and installing it (check, MLX arrays, restack; on the engine thread), its
  bytes and what the resident set holds (factors and stacks);
* the decode gap while one loads: the longest gap between two tokens of 4 streams
  decoding while an adapter loads, against their median step, with the files read off the
  engine thread (the gateway's way) and, for comparison, read on it.

On Linux, preload the system OpenBLAS (``gateway/cpu/blas.py``).

Usage::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/bench_lora.py [--model PATH] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_kv_quant import Sink  # noqa: E402
from bench_speculative import smol_shaped_model  # noqa: E402
from scenarios import words, write_results  # noqa: E402

KEYS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def write_adapter(path: Path, model, seed: int, rank: int = 8, num_layers: int = 16) -> str:
    """A random mlx-lm adapter (``lora_b`` nonzero) for the last ``num_layers`` blocks."""
    import mlx.core as mx

    from scheduler.lora.files import _base, linear_shape

    mx.random.seed(seed)
    names = {id(m): n for n, m in model.named_modules()}
    weights = {}
    for layer in list(model.layers)[-num_layers:]:
        modules = dict(layer.named_modules())
        for k in KEYS:
            inp, out = linear_shape(_base(modules[k]))
            weights[f"{names[id(layer)]}.{k}.lora_a"] = mx.random.normal((inp, rank)) * 0.02
            weights[f"{names[id(layer)]}.{k}.lora_b"] = mx.random.normal((rank, out)) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "adapters.safetensors"), weights)
    (path / "adapter_config.json").write_text(json.dumps({
        "fine_tune_type": "lora", "num_layers": num_layers,
        "lora_parameters": {"rank": rank, "scale": 20.0, "dropout": 0.0, "keys": KEYS}}))
    return str(path)


def submit(engine, prompts, adapters, max_tokens: int) -> list[Sink]:
    from scheduler import EngineRequest, SamplingParams

    sinks = [Sink() for _ in prompts]
    with engine.arrivals.prepare():
        for i, (p, a, s) in enumerate(zip(prompts, adapters, sinks)):
            engine.submit(EngineRequest(f"b{time.monotonic()}-{i}", p, SamplingParams(max_tokens=max_tokens), s,
                                        adapter=a))
    return sinks


def decode_rate(sinks: list[Sink]) -> float:
    """Tokens after each stream's first, over first first token to last token (tokens/s)."""
    for s in sinks:
        s.done.wait(3600)
    start = min(s.times[0] for s in sinks)
    end = max(s.times[-1] for s in sinks)
    return sum(len(s.times) - 1 for s in sinks) / (end - start)


def step_seconds(model, lora, slots: list[int], steps: int = 12) -> float:
    """Median seconds of one decode forward of ``len(slots)`` rows (row ``i`` under slot
    ``slots[i]``, 0 the base) after a 32-token prompt: the forward alone, no scheduling."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    uids = list(range(len(slots)))
    cache = make_prompt_cache(model)
    with lora.rows.forward(lambda: uids, lambda u: slots[u]):
        mx.eval(model(mx.array([[7 + i] * 32 for i in uids]), cache=cache))
        x, times = mx.array([[11]] * len(uids)), []
        for _ in range(steps):
            t = time.perf_counter()
            mx.eval(model(x, cache=cache))
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def load_gap(engine, lora, tok, path: str, off_thread: bool) -> dict:
    """Load the adapter at ``path`` (as ``a4``, replacing it) while 4 streams decode: the
    longest gap between two tokens of a stream around the load, their median step, and the
    seconds the load held the engine thread."""
    from scheduler.lora import read_files

    prompts = [tok.encode(words(64, 9000 + i))[:64] for i in range(4)]
    sinks = submit(engine, prompts, ["a0", "a1", None, "a2"], 120)
    while min(len(s.times) for s in sinks) < 20:
        time.sleep(0.01)
    t_load = time.monotonic()
    if off_thread:
        files = read_files(path)
        t_engine = time.monotonic()
        engine.call(lambda: lora.install("a4", files))
    else:
        t_engine = time.monotonic()
        engine.call(lambda: lora.load("a4", path))
    t_done = time.monotonic()
    for s in sinks:
        s.done.wait(3600)
    gaps = [b - a for s in sinks for a, b in zip(s.times, s.times[1:])]
    during = [b - a for s in sinks for a, b in zip(s.times, s.times[1:]) if b >= t_load and a <= t_done]
    return {"gap_s": round(max(during), 4) if during else 0.0, "median_step_s": round(statistics.median(gaps), 4),
            "engine_thread_s": round(t_done - t_engine, 4), "load_s": round(t_done - t_load, 4)}


def main() -> None:
    import mlx_lm

    from cache import PromptCacheManager
    from gateway.backend import backend
    import mlx.core as mx

    from scheduler import Engine
    from scheduler.lora import adapters_of, read_files

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the end-to-end decode rates (0: none)")
    ap.add_argument("--forward-rounds", type=int, default=5, help="paired rounds of the decode forward alone")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.model == "default":
        from gateway.models.default_model import default_model_dir

        args.model = str(default_model_dir())
    model_dir = args.model or smol_shaped_model()
    model, tok = mlx_lm.load(model_dir)
    tuning = backend()  # as the gateway prepares a model it serves
    tuning.start(model_dir)
    tuning.prepare_weights(model)
    tuning.prepare(model)
    root = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    paths = [write_adapter(root / f"a{i}", model, i) for i in range(5)]
    lora = adapters_of(model, create=True, max_loras=8, max_rank=64)
    engine = Engine(model, tok.eos_token_ids, PromptCacheManager(1 << 30, 64), prompt_concurrency=16,
                    decode_concurrency=16, gather_wait=30.0)
    engine.start()
    results: dict = {"model": model_dir, "decode_tokens_per_s": {}}
    try:
        mx.eval(mx.zeros(1))
        before = mx.get_active_memory()
        t0 = time.perf_counter()
        files = read_files(paths[0])
        t1 = time.perf_counter()
        weights = engine.call(lambda: lora.install("a0", files))
        t2 = time.perf_counter()
        results["load_seconds"] = {"read (off the engine thread)": round(t1 - t0, 4),
                                   "install (on the engine thread)": round(t2 - t1, 4)}
        results["adapter_bytes"] = weights.nbytes
        results["resident_bytes_one_adapter"] = lora.nbytes
        results["active_memory_growth_one_adapter"] = mx.get_active_memory() - before
        for i in range(1, 4):
            engine.call(lambda i=i: lora.load(f"a{i}", paths[i]))
        seed = 0
        best = results["decode_tokens_per_s"]
        for _ in range(args.rounds):  # settings interleaved, the best of each kept (a shared machine's noise)
            for streams in (4, 16):
                for name, pick in (("base", lambda i: None), ("one adapter", lambda i: "a0"),
                                   ("four adapters", lambda i: f"a{i % 4}")):
                    seed += 1
                    prompts = [tok.encode(words(64, seed * 100 + i))[:64] for i in range(streams)]
                    rate = decode_rate(submit(engine, prompts, [pick(i) for i in range(streams)], args.max_tokens))
                    key = f"{streams} streams, {name}"
                    best[key] = max(best.get(key, 0.0), round(rate, 1))
                    print(f"{key:26s}: {rate:7.1f} decode tokens/s", flush=True)
        forward: dict = {}
        paired: dict = {}
        for _ in range(args.forward_rounds):  # interleaved: each round's three settings back to back
            for streams in (4, 16):
                got = {}
                for name, slots in (("base", [0] * streams), ("one adapter", [1] * streams),
                                    ("four adapters", [1 + i % 4 for i in range(streams)])):
                    key = f"{streams} streams, {name}"
                    got[name] = engine.call(lambda slots=slots: step_seconds(model, lora, slots), timeout=600)
                    forward[key] = min(forward.get(key, 1e9), got[name])
                paired.setdefault(f"{streams} streams one / base", []).append(got["base"] / got["one adapter"])
                paired.setdefault(f"{streams} streams mixed / one", []).append(got["one adapter"] / got["four adapters"])
        results["decode_forward_ms"] = {k: round(v * 1e3, 2) for k, v in forward.items()}
        results["forward speed ratios, median of paired rounds"] = {
            k: round(statistics.median(v), 3) for k, v in paired.items()}
        results["forward speed ratios, each round"] = {k: [round(x, 3) for x in v] for k, v in paired.items()}
        print(json.dumps({k: results[k] for k in ("decode_forward_ms", "forward speed ratios, each round")},
                         indent=1), flush=True)
        for where in ("off the engine thread", "on the engine thread", "off the engine thread"):
            gap = load_gap(engine, lora, tok, paths[4], off_thread=where.startswith("off"))
            results.setdefault("decode_gap_while_loading", {}).setdefault(where, []).append(gap)
            print(f"decode gap while an adapter loads, files read {where}: {gap}", flush=True)
        results["resident_bytes"] = lora.nbytes
    finally:
        engine.stop()
    r = results["decode_tokens_per_s"]
    for n in (4, 16) if r else ():
        results[f"ratio {n} streams mixed / one"] = round(r[f"{n} streams, four adapters"] / r[f"{n} streams, one adapter"], 3)
        results[f"ratio {n} streams one / base"] = round(r[f"{n} streams, one adapter"] / r[f"{n} streams, base"], 3)
    print(json.dumps(results, indent=1))
    if args.out:
        write_results(args.out, {"lora.json": results})


if __name__ == "__main__":
    main()
