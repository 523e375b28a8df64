"""One prompt at a time: the gateway's prefill and decode speed against mlx-lm's own
``BatchGenerator`` (what ``batch_generate`` runs) on the same weights, in one run;
prints figures, asserts nothing.

The model (``--model DIR``; default: the default model, SmolLM2-135M-Instruct, as
``mlx-gateway fetch-default-model`` prepares it) is served by ``mlx-gateway serve`` (its
CPU paths chosen by its own measurements at load, as on any machine) and loaded by a
worker process running mlx-lm alone: its weights converted to float32 exactly as the
gateway converts them, MLX's own attention and glibc's malloc, the same BLAS (preload
the system OpenBLAS for both: ``gateway/cpu/blas.py``). For each ``--lengths`` prompt
length, the two take turns on a prompt of exactly that many token ids (random words of
the model's tokenizer, new for every run, so that nothing is cached), greedy, EOS
banned, ``--decode`` tokens. A length past the model's context (``max_position_embeddings``)
is run on a copy of the model (the same weight files, linked) whose config stretches its
RoPE linearly to cover it (``rope_scaling`` ``linear``: the same compute per token):

* prefill tokens/s: prompt tokens over the time to the first token (the gateway's over
  HTTP, streamed ``/v1/completions``; mlx-lm's from ``insert`` to its first token);
* decode tokens/s: the tokens after the first over the time from the first to the last
  (the gateway's also as its request log times them, ``ttft_seconds`` to
  ``total_seconds``: the client's reading of the stream, on the same CPU, left out).

The gateway runs with its defaults, speculative decoding by prompt lookup included (a
greedy answer that repeats itself decodes faster for it); ``--gateway-args="--speculative
off"`` compares the plain decode step.
``--repeat N`` runs each length N times, the two alternating; figures are medians, the
ratio is of the medians. The gateway's request log gives its per-phase times (``phases``,
medians). ``--out DIR`` writes ``vs_mlx_lm.json`` and ``vs_mlx_lm.md``.

Usage::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/bench_vs_mlx_lm.py [--model DIR] [--lengths 500,2000,8000] [--decode 32] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scenarios import free_port, start, tokenizer, words, write_results  # noqa: E402
from gateway.telemetry.request_log import read_json_log  # noqa: E402


def prompt_ids(model_dir: str, n: int, seed: int) -> list[int]:
    """Exactly ``n`` token ids of random words (no special tokens)."""
    tok = tokenizer(model_dir)
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(" " + words(max(64, n), seed + len(ids)), add_special_tokens=False)
    return ids[:n]


def stretched(model_dir: str, tokens: int) -> str:
    """``model_dir``, or a copy of it (weights linked) whose context is stretched to
    ``tokens`` by linear RoPE scaling when its ``max_position_embeddings`` is shorter."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    context = config.get("max_position_embeddings") or tokens
    if tokens <= context or config.get("rope_scaling"):
        return model_dir
    out = Path(tempfile.mkdtemp(prefix="stretched-"))
    for f in Path(model_dir).iterdir():
        (out / f.name).symlink_to(f.resolve())
    (out / "config.json").unlink()
    factor = -(-tokens // context)
    config.update(max_position_embeddings=context * factor, rope_scaling={"type": "linear", "factor": factor})
    (out / "config.json").write_text(json.dumps(config))
    print(f"context {context} < {tokens} tokens: serving {out}, RoPE stretched linearly x{factor}", flush=True)
    return str(out)


def eos_ids(model_dir: str) -> list[int]:
    return sorted(tokenizer(model_dir).eos_token_ids)


# ----------------------------------------------------------------------------- mlx-lm worker
def worker(model_dir: str) -> None:
    """Serve timing requests on stdin (one JSON line each: ``tokens``, ``decode``) with
    mlx-lm's BatchGenerator; one JSON line of figures per request on stdout."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import BatchGenerator

    from gateway.cpu.weights import float32_weights

    model, tok = mlx_lm.load(model_dir)
    float32_weights(model, limit_bytes=1 << 40)  # the gateway's weights: float32 where it converts them
    mx.eval(model.parameters())
    banned = eos_ids(model_dir)

    def no_eos(tokens, logits):
        return logits.at[:, banned].add(-1e9) if banned else logits

    def run(tokens: list[int], decode: int) -> dict:
        gen = BatchGenerator(model, max_tokens=decode, stop_tokens=None, prefill_step_size=2048,
                             logits_processors=[no_eos])
        t0 = time.perf_counter()
        gen.insert([tokens], [decode])
        first = end = None
        n = 0
        while responses := gen.next_generated():
            for r in responses:
                n += 1
                first = first or time.perf_counter()
        end = time.perf_counter()
        gen.close()
        return {"ttft": first - t0, "decode_s": end - first, "completion": n}

    run([5, 6, 7, 8] * 8, 4)  # warm-up
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        print(json.dumps(run(req["tokens"], req["decode"])), flush=True)


# ----------------------------------------------------------------------------- gateway side
def stream_completion(url: str, tokens: list[int], decode: int, bias: dict) -> dict:
    body = {"model": "m", "prompt": tokens, "max_tokens": decode, "temperature": 0, "stream": True,
            "logit_bias": bias, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, usage = None, {}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            if chunk.get("choices") and chunk["choices"][0].get("text") and first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    return {"ttft": first - t0, "decode_s": end - first, "completion": usage.get("completion_tokens", 0)}


def requests_logged(log_path: Path) -> list[dict]:
    """The completions requests of a ``--log-format json`` log, in order."""
    return [rec for rec in read_json_log(log_path)
            if isinstance(rec.get("phases"), dict) and rec.get("endpoint") == "completions"]


def figures(r: dict, n: int) -> dict:
    return {"prefill_tok_s": n / r["ttft"], "decode_tok_s": (r["completion"] - 1) / r["decode_s"],
            "ttft": r["ttft"], "completion": r["completion"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: the default model)")
    ap.add_argument("--lengths", default="500,2000,8000", help="prompt lengths in tokens (comma-separated)")
    ap.add_argument("--decode", type=int, default=32, help="generated tokens per request")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--gateway-args", default="", help="extra `serve` flags")
    ap.add_argument("--out", help="directory for vs_mlx_lm.json and vs_mlx_lm.md")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return
    if args.model:
        model_dir = args.model
    else:
        from gateway.models.default_model import ensure_default_model

        model_dir = str(ensure_default_model())
    lengths = [int(x) for x in args.lengths.split(",")]
    model_dir = stretched(model_dir, max(lengths) + args.decode)
    bias = {str(t): -100 for t in eos_ids(model_dir)}
    port = free_port()
    log = Path(tempfile.mkdtemp()) / "gateway.log"
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--model", model_dir, "--served-model-name", "m",
           "--port", str(port), "--log-format", "json", "--no-precompute-next-turn", *args.gateway_args.split()]
    with open(log, "w") as f:
        server, _ = start(cmd, port, env=dict(os.environ), log=f)
    mlx = subprocess.Popen([sys.executable, __file__, "--worker", model_dir], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    runs: dict = {n: {"gateway": [], "mlx-lm": []} for n in lengths}
    try:
        assert json.loads(mlx.stdout.readline()).get("ready")
        stream_completion(url, prompt_ids(model_dir, 32, 999), 4, bias)  # warm-up
        seed = 0
        for rep in range(args.repeat):
            for n in lengths:
                for side in (("gateway", "mlx-lm") if rep % 2 == 0 else ("mlx-lm", "gateway")):
                    seed += 1
                    tokens = prompt_ids(model_dir, n, seed)
                    if side == "gateway":
                        r = stream_completion(url, tokens, args.decode, bias)
                    else:
                        mlx.stdin.write(json.dumps({"tokens": tokens, "decode": args.decode}) + "\n")
                        mlx.stdin.flush()
                        r = json.loads(mlx.stdout.readline())
                    runs[n][side].append(figures(r, n))
                    print(f"  {n:6d} tokens, {side:8s}: prefill {runs[n][side][-1]['prefill_tok_s']:8.1f} tok/s, "
                          f"decode {runs[n][side][-1]['decode_tok_s']:6.2f} tok/s", flush=True)
    finally:
        mlx.stdin.close()
        for proc in (mlx, server):  # a worker freeing a 30,000-token cache can take minutes: not waited for
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    logged = requests_logged(log)[1:]  # after the warm-up, in the order they ran
    steps = [r["phases"] for r in logged]
    by_length: dict = {}
    for r in logged:
        if r.get("completion_tokens", 0) > 1 and r.get("total_seconds", 0) > r.get("ttft_seconds", 0):
            by_length.setdefault(r["prompt_tokens"], []).append(
                (r["completion_tokens"] - 1) / (r["total_seconds"] - r["ttft_seconds"]))
    choices = [r["message"] for r in read_json_log(log) if "chosen by measurement" in r.get("message", "")]
    med = {n: {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for side, rs in by.items()}
           for n, by in runs.items()}
    lines = ["| prompt tokens | gateway prefill tok/s | mlx-lm prefill tok/s | ratio | gateway decode tok/s | "
             "mlx-lm decode tok/s | ratio | gateway decode tok/s, its log | ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for n in lengths:
        g, m = med[n]["gateway"], med[n]["mlx-lm"]
        served = statistics.median(by_length[n]) if by_length.get(n) else float("nan")
        lines.append(f"| {n} | {g['prefill_tok_s']:.1f} | {m['prefill_tok_s']:.1f} | "
                     f"{g['prefill_tok_s'] / m['prefill_tok_s']:.2f} | {g['decode_tok_s']:.2f} | "
                     f"{m['decode_tok_s']:.2f} | {g['decode_tok_s'] / m['decode_tok_s']:.2f} | {served:.2f} | "
                     f"{served / m['decode_tok_s']:.2f} |")
    md = "\n".join(lines)
    print(md)
    print("chosen at load:\n  " + "\n  ".join(c for c in choices))
    if steps:
        keys = sorted({k for s in steps for k in s})
        print("gateway phases (median s): " + ", ".join(
            f"{k} {statistics.median(s.get(k, 0.0) for s in steps):.3f}" for k in keys))
    if args.out:
        write_results(args.out, {"vs_mlx_lm.json": {"runs": runs, "medians": med, "choices": choices, "phases": steps},
                                 "vs_mlx_lm.md": md})


if __name__ == "__main__":
    main()
