"""Speculative decoding (``--speculative ngram``, and ``draft`` with ``--draft-model`` or
``--draft-layers``) against ``--speculative off``, in one run; prints figures, asserts
nothing.

Model: ``--model PATH`` (for instance the default model, SmolLM2-135M-Instruct, whose real
weights copy their context), else a random-weight model of SmolLM2-135M's shape (llama,
30 layers, hidden 576, 9 heads, 3 KV heads) with the Llama 3 tokenizer (its vocabulary,
128k tokens, makes the output layer about 2.6x SmolLM2's), float32. Each setting is a
fresh ``mlx-gateway serve`` subprocess; the workloads, streamed over the chat API:

* ``code-edit``: the prompt holds a ~1,500-token source file (``scheduler/batch/__init__.py``) and
  asks for it back with one rename; greedy, ``--answer`` tokens. Random weights do not
  edit the file: their greedy output falls into a loop within a few tokens, which prompt
  lookup predicts almost perfectly, so there the figure is the mechanism's ceiling, not
  what a real model gets.
* ``no-repetition``: fresh random words, sampled at temperature 1, unseeded (a seeded row
  does not draft); the output never repeats, so drafts are rare: what speculation costs
  when it does not help. Its outputs are random draws, so they are not compared; each
  stream writes ``--answer`` tokens (``ignore_eos``), so that an end token drawn early in
  one setting does not leave it a smaller batch to decode than the other.

Each at every count of concurrent streams in ``--streams`` (default ``1,4``; a single
number ``N`` means ``1,N``); ``--code-chars`` sets the source file's size (6,000
characters: about 1,450 tokens of SmolLM2's tokenizer; 4,000: about 950). Figures per row: decode
tokens/s (completion tokens after the first, over the time from the first token to the
end of the stream, ``scenarios.stream_chat``, summed over the streams), the ratio
ngram / off, acceptance rate (accepted / drafted tokens, from ``/metrics``, summed over
the runs), tokens per row and decode step, and
whether every output was the same text as with ``off`` (for sampled output, only while no
draft was verified: speculative sampling keeps the distribution, not the draws). It also
prints what a verification forward costs here: ``[B, W]`` against ``[B, 1]`` over a
1,500-token context, in process.
``--draft-model PATH`` adds the ``draft`` setting with that draft model;
``--draft-layers N`` with a draft cut from the model itself: its embedding, first ``N``
layers, final norm and output layer (a layer-skipping self-draft, as in Zhang et al., 2023,
"Draft & Verify"), written next to the model.
``--shape qwen3_5`` or ``--shape gemma3_text`` gives the random model Qwen 3.5's
recurrent layers or Gemma 3's sliding windows at the same size (their rejected drafts
go back by a replay, ``scheduler.speculative.rewind``).
``--synthetic-pair N`` serves a random-weight target and draft that agree (see
:func:`synthetic_pair`), to measure the draft method's mechanism where no trained pair is
at hand.
``--repeat N`` runs each setting N times, taking turns, each figure the median.
``--out DIR`` writes ``speculative.json`` and ``speculative.md``. On Linux, preload the
system OpenBLAS (``gateway/cpu/blas.py``).

Usage::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/bench_speculative.py [--model PATH] [--answer 128] [--streams 4] [--repeat 1] \\
            [--methods ngram] [--draft-model PATH | --draft-layers N] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scenarios import free_port, gateway_cmd, serving, stream_chat, words, write_results  # noqa: E402

SMOL_SHAPE = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
              "head_dim": 64, "intermediate_size": 1536, "rope_theta": 100000.0, "max_position_embeddings": 8192}


# Other layer mixes at SmolLM2-135M's size (--shape): Qwen 3.5's (three gated delta
# layers to one full-attention layer) and Gemma 3's (five 512-token sliding windows to
# one full-attention layer).
LAYER_MIXES = {
    "llama": {},
    "qwen3_5": {"linear_num_value_heads": 8, "linear_num_key_heads": 4, "linear_key_head_dim": 64,
                "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "full_attention_interval": 4},
    "gemma3_text": {"sliding_window": 512, "sliding_window_pattern": 6, "query_pre_attn_scalar": 64},
}


def smol_shaped_model(arch: str = "llama") -> str:
    """A random-weight model of SmolLM2-135M's size with the Llama 3 fixture tokenizer:
    a llama of its shape, or the layer mix of ``arch`` (:data:`LAYER_MIXES`)."""
    from gateway.models.demo_model import build_model_dir

    tokenizer = ROOT / "tests" / "fixtures" / "tokenizers" / "llama3"
    name = "mlx-gateway-bench-smol135-shape" + ("" if arch == "llama" else f"-{arch}")
    return str(build_model_dir(Path(tempfile.gettempdir()) / name, arch,
                               tokenizer_dir=tokenizer, overrides={**SMOL_SHAPE, **LAYER_MIXES[arch]}))


def synthetic_pair(n: int, damp: float = 0.05) -> tuple[str, str]:
    """A target that a draft of its first ``n`` layers predicts well, standing in for a
    trained pair (random weights have none): SmolLM2-135M's shape with the project's own
    small tokenizer (about 1,000 tokens, so the output layer is cheap, as it is next to a
    large target), the output projections of layers ``n`` on scaled by ``damp``. With
    ``n = 4`` the draft's greedy token is the target's about 80 % of the time."""
    from gateway.models.demo_model import build_model_dir

    base = build_model_dir(Path(tempfile.gettempdir()) / "mlx-gateway-bench-smol135-shape-own", "llama",
                           overrides=SMOL_SHAPE)

    def damped(k: str, v):
        m = re.match(r"model\.layers\.(\d+)\.(self_attn\.o_proj|mlp\.down_proj)\.weight", k)
        return v * damp if m and int(m.group(1)) >= n else v

    target = copy_model(base, f"{base.name}-damped{n}", damped)
    return target, first_layers_draft(target, n)


def copy_model(src: Path, name: str, weight, config: dict | None = None) -> str:
    """A copy of the model directory ``src`` next to it, named ``name``: each weight ``k``
    as ``weight(k, v)`` (None: left out), ``config`` (when given) as its config.json, the
    other files as they are."""
    import mlx.core as mx

    dst = src.parent / name
    dst.mkdir(exist_ok=True)
    weights = {k: w for f in sorted(src.glob("*.safetensors")) for k, v in mx.load(str(f)).items()
               if (w := weight(k, v)) is not None}
    mx.save_safetensors(str(dst / "model.safetensors"), weights)
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if (f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json"
                and not (config is not None and f.name == "config.json")):
            (dst / f.name).write_bytes(f.read_bytes())
    return str(dst)


def first_layers_draft(model_dir: str, n: int) -> str:
    """A copy of ``model_dir`` keeping its first ``n`` layers (weights shared, not retrained)."""
    src = Path(model_dir)
    config = {**json.loads((src / "config.json").read_text()), "num_hidden_layers": n}

    def below(k: str, v):
        m = re.match(r"model\.layers\.(\d+)\.", k)
        return v if m is None or int(m.group(1)) < n else None

    return copy_model(src, f"{src.name}-first{n}", below, config)


def code_prompt(n_chars: int = 6000) -> list[dict]:
    source = (ROOT / "scheduler" / "batch" / "__init__.py").read_text()[:n_chars]
    return [{"role": "user", "content": "Here is a Python file:\n\n```python\n" + source + "\n```\n\n"
             "Write the whole file again with the class `Batch` renamed to `RunningBatch`. "
             "Change nothing else."}]


def metric(text: str, name: str) -> float:
    """Sum of a Prometheus series' samples over its labels (0 when absent)."""
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))


SERIES = ("mlx_gateway_speculative_draft_tokens_total", "mlx_gateway_speculative_accepted_tokens_total",
          "mlx_gateway_speculative_verify_steps_total", "mlx_gateway_decode_tokens_total",
          "mlx_gateway_decode_batch_size_count", "mlx_gateway_decode_batch_size_sum")


CODE_CHARS = [6000]  # --code-chars


async def workload(url: str, model: str, kind: str, streams: int, answer: int) -> dict:
    if kind == "code-edit":
        bodies = [(code_prompt(CODE_CHARS[0] - 40 * i), {"temperature": 0}) for i in range(streams)]
    else:  # every stream writes ``answer`` tokens, so both settings decode the same batch sizes
        bodies = [([{"role": "user", "content": words(60, 900 + i)}], {"temperature": 1.0, "ignore_eos": True})
                  for i in range(streams)]
    async with httpx.AsyncClient(base_url=url, timeout=3600) as c:
        before = (await c.get("/metrics")).text
        rs = await asyncio.gather(*(stream_chat(c, messages, answer, model, **extra) for messages, extra in bodies))
        after = (await c.get("/metrics")).text
    delta = {s: metric(after, s) - metric(before, s) for s in SERIES}
    drafted, accepted = delta[SERIES[0]], delta[SERIES[1]]
    return {"decode_tok_s": sum((r["completion"] - 1) / r["decode_s"] for r in rs if r["decode_s"] > 0),
            "texts": [r["text"] for r in rs], "tokens": sum(r["completion"] for r in rs), "drafted": drafted,
            "accepted": accepted,
            "tokens_per_row_step": delta[SERIES[3]] / delta[SERIES[5]] if delta[SERIES[5]] else None,
            "verify_steps": delta[SERIES[2]], "decode_steps": delta[SERIES[4]]}


def run_setting(model_dir: str, speculative: str, streams: list[int], answer: int, k: int,
                draft: str | None = None) -> dict:
    port = free_port()
    cmd = gateway_cmd(port, "--model", model_dir, "--served-model-name", "m", "--speculative", speculative,
                      "--num-draft-tokens", str(k), "--no-precompute-next-turn",
                      "--decode-concurrency", str(max(8, *streams)))
    if speculative == "draft":
        cmd += ["--draft-model", draft]
    with serving(cmd, port) as (url, _):
        out = {}
        for kind in ("code-edit", "no-repetition"):
            for n in streams:
                asyncio.run(workload(url, "m", kind, n, 8))  # warm-up: compiles, fills allocator pools
                out[f"{kind}/{n}"] = asyncio.run(workload(url, "m", kind, n, answer))
        return out


def batch_cache(model, B: int) -> list:
    """An empty batch cache of ``B`` rows for ``model``: per layer, full attention, a
    sliding window or recurrent state, as the model keeps them."""
    from mlx_lm.models.cache import (ArraysCache, BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache,
                                     make_prompt_cache)

    out = []
    for c in make_prompt_cache(model):
        if isinstance(c, RotatingKVCache):
            out.append(BatchRotatingKVCache(c.max_size, [0] * B))
        elif isinstance(c, KVCache):
            out.append(BatchKVCache([0] * B))
        elif isinstance(c, ArraysCache):
            out.append(ArraysCache(len(c.cache)))
        else:
            raise TypeError(f"no batch form for a {type(c).__name__}")
    return out


def verify_cost(model_dir: str, context: int = 1500) -> list[tuple]:
    """Per ``(B, W)``: seconds of a ``[B, W]`` forward over ``context`` cached tokens over
    seconds of ``[B, 1]``; and for a model with recurrent or sliding-window layers, the
    same for a step whose rows reject half their drafts (the forward, then the replay of
    the kept tokens, ``scheduler.speculative.rewind``), else None."""
    import mlx.core as mx
    from mlx_lm import load

    from gateway.backend import backend
    from scheduler.speculative.holes import HoledKVCache
    from scheduler.speculative.rewind import Rewind, held_arrays, holed, replay

    model, _ = load(model_dir)
    backend().prepare_weights(model)  # the paths serve would take on this machine
    backend().prepare(model)
    rows = []
    for B in (1, 4):
        caches = holed(batch_cache(model, B))
        mx.eval(model(mx.random.randint(0, 1000, (B, context)), cache=caches))
        full = [c for c in caches if isinstance(c, HoledKVCache)]
        at_context = [(c.offset, c.left_padding, c._idx) for c in full]  # replaced, not written, by a step
        recurrent = bool(Rewind(caches))
        base = None
        for W in (1, 3, 5):
            times, rejecting = [], []
            for rejects in ([False, True] if recurrent and W > 1 else [False]):
                for _ in range(5):
                    saved = Rewind(caches)  # recurrent and window layers go back to this
                    tic = time.perf_counter()
                    out = model(mx.random.randint(0, 1000, (B, W)), cache=caches)
                    if rejects:
                        replay(model, caches, saved, [[1] * ((W + 1) // 2)] * B, W)
                    mx.eval(out, [a for c in caches for a in held_arrays(c)])
                    (rejecting if rejects else times).append(time.perf_counter() - tic)
                    saved.restore()
                    for c, (offset, padding, idx) in zip(full, at_context):
                        c.offset, c.left_padding, c._idx, c.holes = offset, padding, idx, None
            t = statistics.median(times)
            base = base or t
            rows.append((B, W, t / base, statistics.median(rejecting) / base if rejecting else None))
    return rows


def median_runs(runs: list[dict]) -> dict:
    """Per workload, each figure's median over ``runs`` (texts: whether every run gave the
    same as the first, kept as the first run's when so)."""
    out = {}
    for key, first in runs[0].items():
        row = {}
        for name, value in first.items():
            values = [r[key][name] for r in runs]
            if name == "texts":
                row[name] = value if all(v == value for v in values) else None
            elif name in ("drafted", "accepted"):
                row[name] = sum(values)
            elif all(isinstance(v, (int, float)) for v in values):
                row[name] = statistics.median(values)
            else:
                row[name] = value
        out[key] = row
    return out


def same(kind: str, on: dict, off: dict) -> str:
    if kind == "no-repetition":
        return "n/a (sampled)"
    return "yes" if on["texts"] is not None and on["texts"] == off["texts"] else "no"


def table(results: dict, streams: list[int]) -> str:
    lines = ["| workload | streams | method | off tok/s | on tok/s | ratio | acceptance of drafts | "
             "tokens/row-step | same output |",
             "|---|---|---|---|---|---|---|---|---|"]
    for kind in ("code-edit", "no-repetition"):
        for n in streams:
            for method in (m for m in results if m != "off"):
                off, on = results["off"][f"{kind}/{n}"], results[method][f"{kind}/{n}"]
                acc = f"{on['accepted'] / on['drafted']:.2f} of {on['drafted']:.0f}" if on["drafted"] else "no drafts"
                tps = f"{on['tokens_per_row_step']:.2f}" if on["tokens_per_row_step"] else "-"
                lines.append(f"| {kind} | {n} | {method} | {off['decode_tok_s']:.1f} | {on['decode_tok_s']:.1f} | "
                             f"{on['decode_tok_s'] / off['decode_tok_s']:.2f} | {acc} | {tps} | "
                             f"{same(kind, on, off)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="model directory (default: random weights of SmolLM2-135M's shape)")
    ap.add_argument("--shape", choices=sorted(LAYER_MIXES), default="llama",
                    help="without --model: the random model's layer mix at SmolLM2-135M's size (default llama; "
                    "qwen3_5: gated delta nets, gemma3_text: sliding windows)")
    ap.add_argument("--answer", type=int, default=128, help="answer tokens per request (default 128)")
    ap.add_argument("--streams", default="1,4",
                    help="counts of concurrent streams, comma-separated (default 1,4; N alone: 1,N)")
    ap.add_argument("--code-chars", type=int, default=6000, help="characters of the code-edit source (default 6000)")
    ap.add_argument("--num-draft-tokens", type=int, default=8)
    ap.add_argument("--draft-model", help="also run --speculative draft with this draft model")
    ap.add_argument("--draft-layers", type=int,
                    help="also run --speculative draft with the model's first N layers as its draft")
    ap.add_argument("--synthetic-pair", type=int, metavar="N",
                    help="serve a random-weight target whose layers from N on are damped, with its first N "
                    "layers as the draft (a pair that agrees, standing in for a trained one; see synthetic_pair)")
    ap.add_argument("--methods", default="ngram", help="comma-separated methods besides off (default ngram)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each setting, taking turns; figures are medians")
    ap.add_argument("--out", help="directory for speculative.json and speculative.md")
    args = ap.parse_args()
    args.streams = [int(x) for x in args.streams.split(",")] if "," in args.streams else [1, int(args.streams)]
    CODE_CHARS[0] = args.code_chars
    model_dir = args.model or smol_shaped_model(args.shape)
    if args.synthetic_pair:
        model_dir, args.draft_model = synthetic_pair(args.synthetic_pair)
    cost = verify_cost(model_dir)
    print("verification forward cost (relative to [B, 1], 1,500 cached tokens):")
    for B, W, r, rejecting in cost:
        print(f"  [B={B}, W={W}]: {r:.2f}x" + (f"; with a replay of half the drafts: {rejecting:.2f}x" if rejecting else ""))
    draft = args.draft_model or (first_layers_draft(model_dir, args.draft_layers) if args.draft_layers else None)
    runs = {"off": [], **{m: [] for m in args.methods.split(",") if m}}
    if draft:
        runs["draft"] = []
    for _ in range(args.repeat):  # the settings take turns, so machine drift hits both
        for s in runs:
            runs[s].append(run_setting(model_dir, s, args.streams, args.answer, args.num_draft_tokens, draft))
    results = {s: median_runs(r) for s, r in runs.items()}
    md = table(results, args.streams)
    print(md)
    if args.out:
        slim = {s: {w: {k: v for k, v in r.items() if k != "texts"} for w, r in res.items()}
                for s, res in results.items()}
        write_results(args.out, {"speculative.json": {"cost": cost, "results": slim}, "speculative.md": md})


if __name__ == "__main__":
    main()
