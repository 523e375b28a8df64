"""Image requests beside text streams on the tiny vision-language models (Gemma 3: 1-D
positions; Qwen2.5-VL, Qwen3-VL and Qwen3.5: M-RoPE, each row's positions in its cache). Prints figures (and writes them with ``--out``), asserts nothing.

Each model is served by a fresh gateway process (``mlx-gateway serve``, defaults) and gets:

* image-token throughput: 8 chat requests at once, each with an image never sent before
  (one answer token each), prompt tokens computed over the wall time (best of ``--rounds``);
* TTFT of a request with a new image against the same request again (its prefix, image
  included, from the prefix cache), medians of ``--rounds``;
* the decode gap while images prefill: 4 text streams decoding (64 tokens each) while 4
  requests with new images arrive, the longest gap between two chunks of a text stream
  against their median gap.

The models are random-weight (their answers are noise) and small: the figures show the
engine's overheads (vision tower, per-row positions, scheduling), not a real model's speed.

Usage::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/bench_vision.py [--rounds 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from scenarios import free_port, gateway_cmd, serving, sse_chunks, words, write_results  # noqa: E402
from soak_traffic import png_data_url  # noqa: E402

ARCHS = ["gemma3", "qwen2_5_vl", "qwen3_vl", "qwen3_5_vl"]
SIZE = (224, 160)  # pixels (the tiny Qwen processors cap an image at 64 tokens, Gemma 3's give 16)


def image_message(seed: int, text: str = "What is in this picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_url(seed, SIZE)}},
                                         {"type": "text", "text": text}]}]


async def stream(c: httpx.AsyncClient, messages: list[dict], max_tokens: int) -> dict:
    """One streamed greedy chat answer: ``ttft`` (s), chunk arrival times, prompt/cached tokens."""
    t0 = time.monotonic()
    times, use = [], {}
    body = {"model": "vlm", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    async for chunk in sse_chunks(c, body):
        use = chunk.get("usage") or use
        if any((ch.get("delta") or {}).get("content") for ch in chunk.get("choices", [])):
            times.append(time.monotonic())
    end = time.monotonic()
    return {"ttft": (times[0] if times else end) - t0, "times": times, "end": end, "start": t0,
            "prompt": use.get("prompt_tokens", 0),
            "cached": (use.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0}


async def measure(url: str, rounds: int) -> dict:
    seed = iter(range(1000, 100000))
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        prompt = (await stream(c, image_message(next(seed)), 2))["prompt"]  # warm-up: the first vision run
        # image-token throughput
        best = None
        for _ in range(rounds):
            t0 = time.monotonic()
            rs = await asyncio.gather(*(stream(c, image_message(next(seed)), 1) for _ in range(8)))
            wall = time.monotonic() - t0
            tok_s = sum(r["prompt"] - r["cached"] for r in rs) / wall
            best = max(best or 0.0, tok_s)
        # TTFT: a new image, then the same request again
        new, cached, hits = [], [], []
        for _ in range(rounds):
            msg = image_message(next(seed))
            new.append((await stream(c, msg, 1))["ttft"])
            again = await stream(c, msg, 1)
            cached.append(again["ttft"])
            hits.append(again["cached"])
        # decode gap while images prefill
        gaps, medians = [], []
        for _ in range(rounds):
            text = [[{"role": "user", "content": words(40, k)}] for k in range(4)]
            streams = [asyncio.create_task(stream(c, m, 64)) for m in text]
            await asyncio.sleep(0.3)
            images = [asyncio.create_task(stream(c, image_message(next(seed)), 1)) for _ in range(4)]
            done = await asyncio.gather(*streams, *images)
            steps = [b - a for r in done[:4] for a, b in zip(r["times"], r["times"][1:])]
            gaps.append(max(steps))
            medians.append(statistics.median(steps))
    return {"prompt_tokens_per_request": prompt, "prefill_tok_s_new_images": round(best, 1),
            "ttft_new_image_s": round(statistics.median(new), 4), "ttft_cached_image_s": round(statistics.median(cached), 4),
            "cached_tokens_again": min(hits), "decode_gap_max_s": round(min(gaps), 4),
            "decode_step_median_s": round(statistics.median(medians), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from conftest import model_path

    results = {}
    for arch in ARCHS:
        path = str(model_path(arch))
        port = free_port()
        with serving(gateway_cmd(port, "--model", path, "--served-model-name", "vlm"), port) as (url, _):
            results[arch] = asyncio.run(measure(url, args.rounds))
        print(arch, json.dumps(results[arch]), flush=True)
    lines = ["| model | prompt tokens (image + text) | prefill tok/s (new images) | TTFT new image | TTFT cached image | "
             "decode gap max / median step |", "|---|---|---|---|---|---|"]
    for arch, r in results.items():
        lines.append(f"| {arch} | {r['prompt_tokens_per_request']} | {r['prefill_tok_s_new_images']} | "
                     f"{r['ttft_new_image_s'] * 1000:.0f} ms | {r['ttft_cached_image_s'] * 1000:.0f} ms "
                     f"({r['cached_tokens_again']} cached) | {r['decode_gap_max_s'] * 1000:.0f} / "
                     f"{r['decode_step_median_s'] * 1000:.0f} ms |")
    print("\n".join(lines))
    if args.out:
        write_results(args.out, {"vision.json": results, "vision.md": "\n".join(lines)})


if __name__ == "__main__":
    main()
