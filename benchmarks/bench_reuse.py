"""Prompt reuse across turns: mlx-gateway with and without next-turn precompute, side by
side with ``mlx_lm.server``; prints figures, asserts nothing.

Scenarios (each against a fresh server process; Qwen3's real chat template, whose
default has thinking on):

* ``chat``: a multi-turn chat, each turn sending the whole history with the reply the
  client got, after ``--think-time`` seconds (a person reading; the time precompute
  runs in). Reports prompt tokens reused (cached / prompt, turns 2..N) and TTFT p50 of
  turns 2..N, on a dense model (a qwen3 of 4 layers, hidden 256) and a hybrid one (the
  tiny qwen3_5 test model: linear-attention layers whose state cannot be trimmed).
* ``regenerate``: on the hybrid model, a 10-turn conversation arrives in one request (a
  resumed chat), then the reply of turn 7 is regenerated (its history resent): tokens
  reused of that prompt.

``ceiling`` is all but each turn's new user message and generation prompt. ``ideal`` is
the prompt-only bound: what a server that stored every prompt (and nothing
else) could reuse, the common prefix of each prompt with the one before. mlx_lm.server
stores prompt + completion, which the next prompt rarely shares exactly (the template
re-renders the reply); precompute renders it as the next prompt will.

The models have random weights: replies are random tokens, never a ``<think>`` block,
so the reply the template re-renders differs from the generated tokens only by
re-tokenization and whitespace. (A real thinking model's stored completion diverges at
its first token; ``tests/test_cache_checkpoints.py`` and ``tests/test_next_turn.py``
cover that with the real template.)

Usage::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/bench_reuse.py [--turns 20] [--think-time 1.0] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from scenarios import MEDIUM, free_port, gateway_cmd, serving, stream_chat, tokenizer, words, write_results  # noqa: E402

SYSTEM = "You are a careful assistant for a team that writes serving software. " + words(120, 3)


def dense_model() -> str:
    from conftest import TOKENIZERS, require_tokenizers
    from gateway.models.demo_model import build_model_dir

    require_tokenizers("qwen3")
    return str(build_model_dir(Path(tempfile.gettempdir()) / "mlx-gateway-bench-qwen3-medium-qwen3tok", "qwen3",
                               tokenizer_dir=TOKENIZERS / "qwen3", vocab_size=151936, overrides=MEDIUM))


def hybrid_model() -> str:
    from conftest import model_path

    return str(model_path("qwen3_5"))


def gateway(model: str, port: int, precompute: bool) -> list[str]:
    return gateway_cmd(port, "--model", model, "--precompute-next-turn" if precompute else "--no-precompute-next-turn",
                       "--log-level", "WARNING")


def mlx_lm_server(model: str, port: int, precompute: bool) -> list[str]:
    return [sys.executable, "-m", "mlx_lm.server", "--model", model, "--port", str(port), "--log-level", "WARNING"]


SERVERS = {"gateway+precompute": (gateway, True), "gateway": (gateway, False), "mlx_lm.server": (mlx_lm_server, False)}


def ideal(prompts: list[int], shared: list[int]) -> float:
    """Prompt-only bound over turns 2..N: sum of each prompt's common prefix with the one
    before (``shared``) over the sum of prompt lengths."""
    return sum(shared[1:]) / sum(prompts[1:])


async def chat(url: str, model: str, turns: int, think: float, max_tokens: int) -> dict:
    messages = [{"role": "system", "content": SYSTEM}]
    rows = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        for t in range(turns):
            messages.append({"role": "user", "content": words(25 + 7 * (t % 4), 700 + t)})
            r = await stream_chat(c, messages, max_tokens, model)
            rows.append(r)
            messages.append({"role": "assistant", "content": r["text"]})
            await asyncio.sleep(think)
    later = rows[1:]
    return {"reused": sum(r["cached"] for r in later) / sum(r["prompt"] for r in later),
            "ttft_p50": statistics.median(r["ttft"] for r in later), "messages": messages}


async def regenerate(url: str, model: str, history: list[dict], turn: int) -> dict:
    """Send ``history`` whole, then regenerate the reply of user turn ``turn`` (1-based)."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        await stream_chat(c, history, 8, model)
        users = [i for i, m in enumerate(history) if m["role"] == "user"]
        r = await stream_chat(c, history[:users[turn - 1] + 1], 8, model)
    return {"cached": r["cached"], "prompt": r["prompt"], "ttft": r["ttft"]}


def run(cmd_fn, model: str, precompute: bool, work) -> dict:
    port = free_port()
    with serving(cmd_fn(model, port, precompute), port) as (url, _):
        return asyncio.run(work(url, model))


def bounds(model: str, messages: list[dict]) -> tuple[float, float]:
    """(prompt-only bound, ceiling) of a played chat (its final messages), with the real
    template. The ceiling is all but each turn's new user message and generation prompt:
    what a server that also had every reply rendered as the next prompt shows it could
    reuse."""
    from cache.checkpoints import common_prefix
    from gateway.conversation.next_turn import next_turn_prefix

    tok = tokenizer(model)
    prompts, shared, ceiling, prev = [], [], [], []
    for i, m in enumerate(messages):
        if m["role"] != "user":
            continue
        p = list(tok.apply_chat_template(messages[:i + 1], tokenize=True, add_generation_prompt=True))
        prompts.append(len(p))
        shared.append(common_prefix(prev, p))
        if i >= 2 and messages[i - 1]["role"] == "assistant":
            pre = next_turn_prefix(tok, messages[:i - 1], {}, messages[i - 1]["content"]) or []
            ceiling.append(common_prefix(pre, p))
        else:
            ceiling.append(0)
        prev = p
    return ideal(prompts, shared), ideal(prompts, ceiling)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--hybrid-turns", type=int, default=10)
    ap.add_argument("--think-time", type=float, default=1.0, help="seconds between a reply and the next turn")
    ap.add_argument("--max-tokens", type=int, default=48, help="reply length (tokens)")
    ap.add_argument("--out", type=Path, help="also write reuse.json and reuse.md here")
    args = ap.parse_args()

    results: dict = {}
    for kind, model, turns in (("dense", dense_model(), args.turns), ("hybrid", hybrid_model(), args.hybrid_turns)):
        for name, (cmd_fn, pre) in SERVERS.items():
            res = run(cmd_fn, model, pre, lambda url, m: chat(url, m, turns, args.think_time, args.max_tokens))
            messages = res.pop("messages")
            res["ideal"], res["ceiling"] = bounds(model, messages)
            results[f"chat {kind} ({turns} turns)", name] = res
            print(f"chat {kind:6s} {name:20s} reused={res['reused']:.1%} ideal={res['ideal']:.1%} "
                  f"ceiling={res['ceiling']:.1%} "
                  f"ttft_p50={res['ttft_p50'] * 1000:.1f} ms", flush=True)
            if kind == "hybrid" and name == "gateway":
                history = messages[:-1]  # the played conversation, up to its last user message
    model = hybrid_model()
    for name, (cmd_fn, pre) in SERVERS.items():
        res = run(cmd_fn, model, pre, lambda url, m: regenerate(url, m, history, 7))
        results["regenerate turn 7 (hybrid)", name] = res
        print(f"regenerate hybrid {name:20s} reused {res['cached']} of {res['prompt']} "
              f"ttft={res['ttft'] * 1000:.1f} ms", flush=True)

    lines = ["| scenario | server | prompt tokens reused | prompt-only bound | ceiling | TTFT p50 (turns 2..N) |",
             "|---|---|---|---|---|---|"]
    for (scenario, name), r in results.items():
        if "reused" in r:
            lines.append(f"| {scenario} | {name} | {r['reused']:.1%} | {r['ideal']:.1%} | {r['ceiling']:.1%} | "
                         f"{r['ttft_p50'] * 1000:.1f} ms |")
        else:
            lines.append(f"| {scenario} | {name} | {r['cached']} of {r['prompt']} | | | {r['ttft'] * 1000:.1f} ms |")
    table = "\n".join(lines)
    print("\n" + table)
    if args.out:
        write_results(args.out, {"reuse.md": table,
                                 "reuse.json": [{"scenario": s, "server": n, **r} for (s, n), r in results.items()]})


if __name__ == "__main__":
    main()
