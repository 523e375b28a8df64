"""Prompt-cache memory per unique token, and restart-to-hit TTFT with the disk tier;
prints figures, asserts nothing.

Memory scenarios (each against a fresh gateway; Qwen3's real chat template, thinking on):

* ``chat``: a 20-turn chat, each turn resending the history with the reply the client
  got (next-turn precompute on, as by default).
* ``branching``: the same chat, then turns 7 and 14 regenerated (their history
  resent) and turn 10 edited (another user message) and continued for two turns.

For each, on a dense model (qwen3, 4 layers, hidden 256) and a hybrid one (qwen3_5:
linear-attention layers whose state is kept per snapshot), it reports the bytes the
prompt cache holds (``mlx_gateway_prompt_cache_bytes``, all types), the conversation's
unique tokens (the size of the token trie of every prompt sent, rendered locally
with the same template, each followed by its reply re-encoded), and

    ratio = bytes held / (unique tokens x KV bytes per token + non-paged bytes held)

where non-paged bytes are the layers kept whole per snapshot (recurrent state).

Restore cost (``restore 4K``): a 4096-token conversation stored as one snapshot per
256-token turn, for a Qwen3-0.6B-like shape (28 layers of 8 KV heads x 128 dims,
float16), then its 4096-token prefix fetched and merged with a 64-token row into a
``BatchKVCache``, as admission does; against the same with the whole-copy snapshots
held before paging (``safe_copy`` + trim of one 4096-token snapshot), median of 10.

Restart scenario (``--disk``): a 20-turn chat on a gateway with ``--prompt-cache-dir``,
a graceful stop (SIGTERM), a new gateway on the same directory, one unrelated request
(a fresh process's first request pays one-time costs), and the next turn: its cached
share and TTFT, against the same next turn on the first gateway (a memory hit) and
repeated on the second.

Usage::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/bench_cache_memory.py [--turns 20] [--disk] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from bench_reuse import SYSTEM, dense_model, hybrid_model  # noqa: E402
from scenarios import (  # noqa: E402
    distinct_prefix_tokens, free_port, gateway_cmd, serving, stream_chat, timed, tokenizer, words, write_results,
)

MAX_TOKENS = 24


def gateway(model: str, port: int, *extra: str) -> list[str]:
    return gateway_cmd(port, "--model", model, "--log-level", "WARNING", *extra)


def kv_bytes_per_token(model: str) -> int:
    """Bytes of full-attention KV one token takes in ``model`` (one forward of one token)."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    m, _ = mlx_lm.load(model)
    cache = make_prompt_cache(m)
    m(mx.array([[1]]), cache=cache)
    return sum(a[..., :1, :].nbytes for c in cache if type(c).__name__ == "KVCache" for a in (c.keys, c.values))


def held(url: str) -> dict[str, float]:
    """Sum of ``mlx_gateway_prompt_cache_bytes`` per cache type, and the tokens gauge."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        m = re.match(r'mlx_gateway_prompt_cache_bytes\{cache_group="[^"]*",cache_type="(\w+)"\} (\S+)', line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0) + float(m.group(2))
        m = re.match(r'mlx_gateway_prompt_cache_tokens\{[^}]*\} (\S+)', line)
        if m:
            out["tokens"] = out.get("tokens", 0) + float(m.group(1))
    return out


def unique_tokens(model: str, sent: list[tuple[list[dict], str]]) -> int:
    """Nodes of the token trie of every (prompt, reply) sent: prompt rendered with the
    model's template, reply re-encoded."""
    tok = tokenizer(model)
    return distinct_prefix_tokens(
        list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))
        + tok.encode(reply, add_special_tokens=False)
        for messages, reply in sent)


async def play(c: httpx.AsyncClient, model: str, messages: list[dict], sent: list, think: float) -> dict:
    r = await stream_chat(c, messages, MAX_TOKENS, model)
    sent.append((list(messages), r["text"]))
    await asyncio.sleep(think)
    return r


async def conversation(url: str, model: str, turns: int, branching: bool, think: float) -> list:
    sent: list = []
    messages = [{"role": "system", "content": SYSTEM}]
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        for t in range(turns):
            messages.append({"role": "user", "content": words(25 + 7 * (t % 4), 700 + t)})
            r = await play(c, model, messages, sent, think)
            messages.append({"role": "assistant", "content": r["text"]})
        if branching:
            users = [i for i, m in enumerate(messages) if m["role"] == "user"]
            for turn in (7, 14):
                await play(c, model, messages[:users[turn - 1] + 1], sent, think)
            edited = messages[:users[9]] + [{"role": "user", "content": words(30, 9000)}]
            for t in range(3):
                r = await play(c, model, edited, sent, think)
                edited = edited + [{"role": "assistant", "content": r["text"]},
                                   {"role": "user", "content": words(20, 9100 + t)}]
        await asyncio.sleep(1.0)  # the last next-turn precompute
    return sent


def memory(model: str, turns: int, branching: bool, think: float) -> dict:
    port = free_port()
    with serving(gateway(model, port), port) as (url, _):
        sent = asyncio.run(conversation(url, model, turns, branching, think))
        h = held(url)
    per_token = kv_bytes_per_token(model)
    unique = unique_tokens(model, sent)
    tokens = h.pop("tokens", None)
    total = sum(h.values())
    non_paged = total - h.get("KVCache", 0)
    return {"bytes": total, "non_paged": non_paged, "unique_tokens": unique, "tokens_held": tokens,
            "kv_per_token": per_token, "ratio": total / (unique * per_token + non_paged),
            "bytes_per_unique_token": total / unique}


def restore_cost(reps: int = 10) -> dict:
    """Seconds to fetch a 4096-token prefix and merge it into a batch: paged vs whole copy."""

    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from cache import PromptCacheManager
    from cache.restore import safe_copy

    layers, heads, dim, n, turn = 28, 8, 128, 4096, 256
    keys = [mx.random.normal((1, heads, n, dim)).astype(mx.float16) for _ in range(layers)]
    mx.eval(keys)

    def snap(t: int) -> list:
        out = []
        for k in keys:
            c = KVCache()
            c.update_and_fetch(k[..., :t, :], k[..., :t, :])
            out.append(c)
        mx.eval([c.keys for c in out])
        return out

    tokens = list(range(1, n + 1))
    mgr = PromptCacheManager(max_bytes=1 << 34, max_entries=1000)
    for t in range(turn, n + 1, turn):
        mgr.insert("b", tokens[:t], snap(t))
    whole = snap(n)
    other = snap(64)

    def merge(cache: list) -> None:
        batch = [a.merge([a, b]) for a, b in zip(cache, safe_copy(other))]  # as mlx-lm's _merge_caches
        mx.eval([c.keys for c in batch])

    def paged() -> None:
        hit = mgr.fetch("b", tokens + [0])
        merge(hit.cache)
        mgr.release(hit.lease)

    def copied() -> None:
        cache = safe_copy(whole)
        merge(cache)

    out = {}
    for name, fn in (("paged", paged), ("whole_copy", copied)):
        out[name] = timed(fn, reps, warmup=True)[0]
    out["held_paged_bytes"] = mgr.nbytes
    return out


async def next_turn(url: str, model: str, messages: list[dict]) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        return await stream_chat(c, messages, MAX_TOKENS, model)


def restart(model: str, turns: int, think: float) -> dict:
    """Memory hit vs disk hit after a graceful restart, for the same next turn."""
    cache_dir = Path(tempfile.mkdtemp(prefix="mlx-gateway-disk-"))
    extra = ("--prompt-cache-dir", str(cache_dir))
    messages = [{"role": "system", "content": SYSTEM}]
    port = free_port()
    with serving(gateway(model, port, *extra), port) as (url, _):  # stopped by SIGTERM: a graceful shutdown
        async def chat() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=600) as c:
                for t in range(turns):
                    messages.append({"role": "user", "content": words(25 + 7 * (t % 4), 700 + t)})
                    r = await stream_chat(c, messages, MAX_TOKENS, model)
                    messages.append({"role": "assistant", "content": r["text"]})
                    await asyncio.sleep(think)
        asyncio.run(chat())
        messages.append({"role": "user", "content": words(30, 5000)})
        memory_hit = asyncio.run(next_turn(url, model, messages))
    port = free_port()
    with serving(gateway(model, port, *extra), port) as (url, boot):
        # One unrelated request first: a fresh process's first request pays one-time costs
        # (first kernels, allocator) that are not the disk's.
        asyncio.run(next_turn(url, model, [{"role": "user", "content": words(20, 4000)}]))
        disk_hit = asyncio.run(next_turn(url, model, messages))
        again = asyncio.run(next_turn(url, model, messages))
    return {"prompt": disk_hit["prompt"], "memory_cached": memory_hit["cached"], "disk_cached": disk_hit["cached"],
            "memory_ttft": memory_hit["ttft"], "disk_ttft": disk_hit["ttft"], "after_ttft": again["ttft"],
            "boot_s": boot, "disk_bytes": sum(f.stat().st_size for f in cache_dir.rglob("*") if f.is_file())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--think-time", type=float, default=0.3, help="seconds between a reply and the next turn")
    ap.add_argument("--disk", action="store_true", help="also run the restart scenario")
    ap.add_argument("--out", type=Path, help="also write cache_memory.json and cache_memory.md here")
    args = ap.parse_args()

    rows = {}
    for kind, model in (("dense", dense_model()), ("hybrid", hybrid_model())):
        for branching in (False, True):
            name = f"{'branching' if branching else 'chat'} {kind}"
            r = rows[name] = memory(model, args.turns, branching, args.think_time)
            print(f"{name:18s} held={r['bytes'] / 1e6:.2f} MB unique={r['unique_tokens']} tokens "
                  f"(held {r['tokens_held']}) kv/token={r['kv_per_token']} B non-paged={r['non_paged'] / 1e6:.2f} MB "
                  f"ratio={r['ratio']:.2f} bytes/unique token={r['bytes_per_unique_token']:.0f}", flush=True)
    rc = restore_cost()
    print(f"restore 4K into a batch: paged {rc['paged'] * 1000:.1f} ms, whole copy {rc['whole_copy'] * 1000:.1f} ms "
          f"({rc['paged'] / rc['whole_copy']:.2f}x)", flush=True)
    lines = ["| scenario | bytes held | unique tokens | KV bytes / token | non-paged bytes | bytes / unique token | ratio |",
             "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['bytes'] / 1e6:.2f} MB | {r['unique_tokens']} | {r['kv_per_token']} | "
                     f"{r['non_paged'] / 1e6:.2f} MB | {r['bytes_per_unique_token']:.0f} | {r['ratio']:.2f} |")
    rows["restore 4K"] = rc
    lines += ["", "| restore a 4096-token prefix into a batch (28 x 8 x 128, fp16) | median |", "|---|---|",
              f"| paged (16 snapshots along the conversation) | {rc['paged'] * 1000:.1f} ms |",
              f"| whole-copy snapshot (before paging) | {rc['whole_copy'] * 1000:.1f} ms |"]
    if args.disk:
        r = rows["restart dense"] = restart(dense_model(), args.turns, args.think_time)
        print(f"restart: memory hit {r['memory_cached']}/{r['prompt']} ttft={r['memory_ttft'] * 1000:.1f} ms; "
              f"disk hit {r['disk_cached']}/{r['prompt']} ttft={r['disk_ttft'] * 1000:.1f} ms "
              f"({r['disk_ttft'] / r['memory_ttft']:.2f}x); then {r['after_ttft'] * 1000:.1f} ms; "
              f"boot {r['boot_s']:.1f} s; disk {r['disk_bytes'] / 1e6:.2f} MB", flush=True)
        lines += ["", "| restart (dense, 20 turns) | prompt | cached | TTFT |", "|---|---|---|---|",
                  f"| memory hit, before the restart | {r['prompt']} | {r['memory_cached']} | {r['memory_ttft'] * 1000:.1f} ms |",
                  f"| disk hit, first request after it | {r['prompt']} | {r['disk_cached']} | {r['disk_ttft'] * 1000:.1f} ms |",
                  f"| the same request again (memory) | {r['prompt']} | | {r['after_ttft'] * 1000:.1f} ms |"]
    table = "\n".join(lines)
    print("\n" + table)
    if args.out:
        write_results(args.out, {"cache_memory.md": table, "cache_memory.json": rows})


if __name__ == "__main__":
    main()
