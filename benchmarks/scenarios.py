"""Workloads for the serving benchmarks: each drives a running server over HTTP and
returns figures (seconds, tokens, tokens/s); none asserts anything.

Every scenario takes the server's base URL and the model name it serves, so the same
workload runs against mlx-gateway and ``mlx_lm.server``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

# A qwen3 larger than the test models (4 layers, hidden 256, ~3M parameters) so that
# prefill cost is visible on a CPU; still random weights. Every benchmark's default model.
MEDIUM = {"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 768,
          "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32}


def medium_model() -> str:
    """Directory of the medium benchmark model (built once, in the temp directory)."""
    from gateway.models.demo_model import build_model_dir

    return str(build_model_dir(Path(tempfile.gettempdir()) / "mlx-gateway-bench-qwen3-medium", "qwen3",
                               overrides=MEDIUM))


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None when matplotlib is not installed
    (``pip install -e '.[bench]'``)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_results(out, files: dict[str, object]) -> None:
    """Write ``files`` (by name: a str as text, anything else as JSON) into the directory ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (out / name).write_text((value if isinstance(value, str) else json.dumps(value, indent=1)) + "\n")


WORDS = ("the model cache token prompt server batch request tenant prefix memory apple code agent "
         "browser extension stream answer question system user assistant reason think water").split()


@functools.lru_cache(maxsize=8)
def tokenizer(model: str):
    """mlx-lm's tokenizer wrapper of the model directory ``model`` (loaded once)."""
    from mlx_lm.tokenizer_utils import load

    return load(Path(model))


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def timed(fn, reps: int, warmup: bool = False, stat=statistics.median):
    """Run ``fn`` ``reps`` times (after one untimed call if ``warmup``); returns
    (``stat`` of the wall times in seconds, the last result)."""
    if warmup:
        fn()
    times, res = [], None
    for _ in range(reps):
        t = time.perf_counter()
        res = fn()
        times.append(time.perf_counter() - t)
    return stat(times), res


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], port: int, env=None, timeout: float = 300, log=None, cwd=None) -> tuple[subprocess.Popen, float]:
    """Start a server in ``cwd`` (its output to the file ``log``, else discarded); returns
    (process, seconds until /health answered)."""
    t0 = time.monotonic()
    out = log if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=out, stderr=out, env=env, cwd=cwd)
    while time.monotonic() - t0 < timeout:
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
            if r.status_code == 200:
                return proc, time.monotonic() - t0
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {cmd}")
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("server did not start")


def gateway_cmd(port: int, *flags: str) -> list[str]:
    """The command line of ``mlx-gateway serve --port PORT FLAGS...`` (this interpreter)."""
    return [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), *flags]


@contextmanager
def serving(cmd: list[str], port: int, env=None, timeout: float = 300, log=None, cwd=None, stop_wait: float = 60):
    """:func:`start` as a context: yields (the server's base URL, seconds until /health
    answered); on exit the server is terminated, and killed after ``stop_wait`` seconds."""
    proc, boot = start(cmd, port, env=env, timeout=timeout, log=log, cwd=cwd)
    try:
        yield f"http://127.0.0.1:{port}", boot
    finally:
        proc.terminate()
        try:
            proc.wait(stop_wait)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def sse_chunks(c: httpx.AsyncClient, body: dict, path: str = "/v1/chat/completions", headers=None):
    """POST ``body`` to ``path`` as a stream and yield each ``data:`` event's JSON object.

    Raises:
        httpx.HTTPStatusError: the server answered with an error status (its body in the message).
    """
    async with c.stream("POST", path, json=body, headers=headers) as r:
        if r.is_error:
            await r.aread()
            raise httpx.HTTPStatusError(f"{r.status_code}: {r.text[:300]}", request=r.request, response=r)
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                yield json.loads(line[6:])


def chunk_text(chunk: dict) -> str:
    """A streamed chat chunk's text over its choices: content and reasoning (the gateway's
    ``reasoning_content``, mlx_lm.server's ``reasoning``)."""
    return "".join((d.get("content") or "") + (d.get("reasoning_content") or d.get("reasoning") or "")
                   for d in (ch.get("delta") or {} for ch in chunk.get("choices", [])))


async def stream_chat(c: httpx.AsyncClient, messages, max_tokens: int, model: str, **extra) -> dict:
    """Stream one greedy chat: its seconds (``ttft``, ``total``, ``decode_s``: first token to
    end), content ``chunks``, ``text`` and its usage's ``prompt``, ``cached``, ``completion``."""
    t0 = time.monotonic()
    first, n, text, use = None, 0, "", {}
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    async for chunk in sse_chunks(c, body):
        use = chunk.get("usage") or use
        piece = chunk_text(chunk)
        if piece:
            first = first or time.monotonic()
            n += 1
            text += piece
    end = time.monotonic()
    cached = ((use.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    return {"ttft": (first or end) - t0, "total": end - t0, "chunks": n, "text": text,
            "prompt": use.get("prompt_tokens", 0), "cached": cached,
            "completion": use.get("completion_tokens", n), "decode_s": end - (first or end)}


def summarize(results: list[dict], wall: float) -> dict:
    ttfts = sorted(r["ttft"] for r in results)
    prompt = sum(r["prompt"] for r in results)
    cached = sum(r["cached"] for r in results)
    return {"ttft_p50": statistics.median(ttfts), "ttft_p95": ttfts[round(0.95 * (len(ttfts) - 1))],
            "computed": prompt - cached, "cached_frac": cached / prompt if prompt else 0.0,
            "tok_s": sum(r["completion"] for r in results) / wall}


async def burst(url: str, model: str, rounds: int = 3) -> dict:
    """6 concurrent chats sharing a ~600-token system prompt with different ~300-token
    user texts: round 1 cold (``cold_wall``: seconds until all six finished,
    ``cold_ttft_p50``), then ``rounds - 1`` repeats whose prompts are all cached
    (``warm_ttft_p50``/``p95``)."""
    system = "You are a careful assistant. " + words(560, 0)
    users = [f"Page {i}: " + words(280, 100 + i) for i in range(6)]
    out, cold = [], {}
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        t0 = time.monotonic()
        for k in range(rounds):
            t_round = time.monotonic()
            rs = await asyncio.gather(*(stream_chat(c, [{"role": "system", "content": system},
                                                        {"role": "user", "content": u}], 16, model) for u in users))
            if k == 0:
                cold = {"cold_wall": time.monotonic() - t_round, "cold_ttft_p50": statistics.median(r["ttft"] for r in rs)}
            out += rs
        res = summarize(out, time.monotonic() - t0)
    warm = sorted(r["ttft"] for r in out[len(users):])
    return {**cold, "warm_ttft_p50": statistics.median(warm), "warm_ttft_p95": warm[int(0.95 * (len(warm) - 1))],
            "computed": res["computed"], "cached_frac": res["cached_frac"]}


async def conversation(url: str, model: str, turns: int = 20) -> dict:
    messages = [{"role": "system", "content": "You help with code. " + words(200, 1)}]
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        t0 = time.monotonic()
        for t in range(turns):
            messages.append({"role": "user", "content": words(60, 500 + t)})
            r = await stream_chat(c, messages, 24, model)
            out.append(r)
            messages.append({"role": "assistant", "content": r["text"]})
        return summarize(out, time.monotonic() - t0)


async def decode_speed(url: str, model: str, n: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        t0 = time.monotonic()
        rs = await asyncio.gather(*(stream_chat(c, [{"role": "user", "content": words(30 + 20 * i, i)}], 64, model)
                                    for i in range(n)))
        wall = time.monotonic() - t0
    return {"ttft_p50": statistics.median(r["ttft"] for r in rs),
            "tok_s_per_request": statistics.median(r["completion"] / max(r["decode_s"], 1e-9) for r in rs),
            "tok_s_total": sum(r["completion"] for r in rs) / wall}


# Exactly 48 one-digit integers: longer than max_tokens, so constrained rows decode as
# long as free ones and the batch keeps its size.
DIGITS = {"type": "json_schema", "json_schema": {"name": "digits", "schema": {
    "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 48, "maxItems": 48}}}


async def constrained(url: str, model: str, n: int = 8, rounds: int = 3) -> dict:
    """Decode tokens/s of ``n`` concurrent requests, none or half of them constrained
    (median of ``rounds``), and the ratio half/none. Free rows get EOS banned
    (``logit_bias``) so that every row decodes all 64 tokens in both runs."""
    no_eos = {"logit_bias": {str(t): -100 for t in tokenizer(model).eos_token_ids}}
    out = {}
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        for k in (0, n // 2):
            speeds = []
            for r in range(rounds):
                rs = await asyncio.gather(*(
                    stream_chat(c, [{"role": "user", "content": words(30, 1000 * r + 100 * k + i)}], 64, model,
                                **({"response_format": DIGITS} if i < k else no_eos))
                    for i in range(n)))
                # Decode only: from the first token of any row to the end of the last.
                window = max(x["total"] for x in rs) - min(x["ttft"] for x in rs)
                speeds.append(sum(x["completion"] for x in rs) / window)
            out[f"tok_s_{k}_of_{n}"] = statistics.median(speeds)
    out["ratio"] = out[f"tok_s_{n // 2}_of_{n}"] / out[f"tok_s_0_of_{n}"]
    return out


def steady_stream_bias(model: str) -> dict[str, int]:
    """A ``logit_bias`` that bans EOS and, for vocabularies up to 4096 tokens, the byte
    tokens that decode to part of a UTF-8 character: random weights otherwise emit runs
    of them that a server holds back until the character completes, which would read as
    a stall of the stream."""
    tok = tokenizer(model)
    banned = set(tok.eos_token_ids)
    vocab = len(tok._tokenizer.get_vocab())
    if vocab <= 4096:
        banned |= {i for i in range(vocab) if "\ufffd" in tok.decode([i])}
    return {str(t): -100 for t in sorted(banned)}


def long_text(model: str, tokens: int, seed: int) -> str:
    """Random words that the model's tokenizer turns into at least ``tokens`` tokens."""
    n = tokens
    while True:
        text = words(n, seed)
        got = len(tokenizer(model).encode(text))
        if got >= tokens:
            return text
        n += max(16, (tokens - got) * n // max(got, 1))


# Seconds: inter-token gaps shorter than this are tokens of one step (a speculative step's
# tokens are sent one after the other, microseconds apart), not the cadence of steps.
SAME_STEP = 0.001


async def stall(url: str, model: str, streams: int = 4, long_tokens: int = 3000, seed: int = 7) -> dict:
    """Decode stall: ``streams`` requests (EOS banned) are decoding when a ``long_tokens``-token
    prompt arrives. Reports the streams' inter-token gaps (seconds) before it arrived
    (``gap_alone_p50``) and from its arrival to its first token (``gap_max``, ``gap_p50``;
    medians over gaps between steps, :data:`SAME_STEP`), the long prompt's TTFT, and the
    TTFT of two prompts of that length sent with nothing decoding, before the streams start
    and after they end (``long_alone_before``, ``long_alone_after``; ``long_alone_ttft``,
    their mean: a slow minute of a noisy machine weighs on both sides)."""
    no_eos = steady_stream_bias(model)
    text, alone_text, after_text = (long_text(model, long_tokens, seed + k) for k in range(3))
    times: list[list[float]] = [[] for _ in range(streams)]

    async def decode(c: httpx.AsyncClient, i: int) -> None:  # notes when each content chunk arrives
        body = {"model": model, "messages": [{"role": "user", "content": words(20, seed * 100 + i)}],
                "max_tokens": 4000, "temperature": 0, "stream": True, "logit_bias": no_eos}
        async for chunk in sse_chunks(c, body):
            if chunk_text(chunk):
                times[i].append(time.monotonic())

    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        alone_ttft = (await stream_chat(c, [{"role": "user", "content": alone_text}], 8, model))["ttft"]
        tasks = [asyncio.create_task(decode(c, i)) for i in range(streams)]
        try:
            while min(len(t) for t in times) < 24:  # all decoding, past their first tokens
                ended = [t for t in tasks if t.done()]
                if ended:  # a stream that ended (or failed) early would be waited for forever
                    raise RuntimeError(f"stall: a stream ended after {min(len(t) for t in times)} content chunks, "
                                       f"before the long prompt was sent: {ended[0].exception()!r}")
                await asyncio.sleep(0.01)
            t_long = time.monotonic()
            r = await stream_chat(c, [{"role": "user", "content": text}], 8, model)
            t_first = t_long + r["ttft"]
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.2)  # the server sees the streams leave and ends them
        after_ttft = (await stream_chat(c, [{"role": "user", "content": after_text}], 8, model))["ttft"]
    alone = [b - a for ts in times for a, b in zip(ts[8:], ts[9:]) if b < t_long]
    during = [b - a for ts in times for a, b in zip(ts, ts[1:]) if b > t_long and a < t_first]
    alone_steps = [g for g in alone if g >= SAME_STEP]
    during_steps = [g for g in during if g >= SAME_STEP]
    return {"gap_alone_p50": statistics.median(alone_steps) if alone_steps else float("nan"),
            "gap_max": max(during, default=float("nan")),
            "gap_p50": statistics.median(during_steps) if during_steps else float("nan"),
            "long_ttft": r["ttft"], "long_prompt": r["prompt"], "long_alone_ttft": (alone_ttft + after_ttft) / 2,
            "long_alone_before": alone_ttft, "long_alone_after": after_ttft}


def distinct_prefix_tokens(sequences) -> int:
    """Tokens of ``sequences`` (token id lists) counted once however many share them:
    the nodes of their token trie."""
    trie: dict = {}
    count = 0
    for seq in sequences:
        node = trie
        for t in seq:
            count += t not in node
            node = node.setdefault(t, {})
    return count


async def load(url: str, model: str, clients: int = 16, turns: int = 4) -> dict:
    """``clients`` agents at once, each a ``turns``-turn chat (a shared ~400-token system
    prompt, ~100 new tokens per turn, 32-token answers sent back in the next turn).
    Reports output tokens/s, TTFT p50/p95, failed requests, and prompt tokens computed
    (prompt - cached) against the ideal: the distinct prompt prefixes, i.e. every token
    of every prompt counted once however many prompts share it."""
    system = "You are a coding agent. " + words(380, 3)
    results, prompts = [], []

    async def agent(c: httpx.AsyncClient, i: int) -> None:
        messages = [{"role": "system", "content": system}]
        for t in range(turns):
            messages.append({"role": "user", "content": words(100, 10_000 + 100 * i + t)})
            prompts.append(tokenizer(model).apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
            try:
                r = await stream_chat(c, messages, 32, model)
            except httpx.HTTPError:
                return  # counted as failed, with the turns it did not get to
            results.append(r)
            messages.append({"role": "assistant", "content": r["text"]})

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=64)) as c:
        t0 = time.monotonic()
        await asyncio.gather(*(agent(c, i) for i in range(clients)))
        wall = time.monotonic() - t0
    ideal = distinct_prefix_tokens(prompts)
    res = summarize(results, wall) if results else {}
    return {"tok_s": res.get("tok_s", 0.0), "ttft_p50": res.get("ttft_p50", float("nan")),
            "ttft_p95": res.get("ttft_p95", float("nan")), "errors": clients * turns - len(results),
            "computed": res.get("computed", 0), "ideal": ideal}


def phase_breakdown(log_path: Path, min_cached_frac: float = 0.9) -> dict[str, float]:
    """Median seconds per TTFT phase (the request log's ``phases``) over the streamed
    requests in a gateway's JSON log whose prompt was at least ``min_cached_frac``
    cached: the per-phase breakdown of a warm hit. Also ``ttft`` and ``requests``."""
    from gateway.telemetry.request_log import read_json_log

    rows = [d for d in read_json_log(log_path) if d.get("stream") and d.get("phases") and d.get("prompt_tokens")
            and d.get("cached_tokens", 0) >= min_cached_frac * d["prompt_tokens"]]
    if not rows:
        return {}
    out = {n: statistics.median(r["phases"].get(n, 0.0) for r in rows) for n in rows[0]["phases"]}
    return {**out, "sum": sum(out.values()), "requests": len(rows)}
