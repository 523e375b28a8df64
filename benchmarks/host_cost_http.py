"""The HTTP side of ``bench_host_cost.py``, and how every side's rate is read from the
times its tokens arrived.

A side's rate is its **steady decode rate**: the tokens that arrived while every stream
was decoding (from the last stream's first token to the first stream's last), per second
of that window. A server that starts its streams at different times (``mlx_lm.server``
takes connections one handler thread at a time) then gets no credit for the part of a
run where fewer streams were left: counting ``decode - 1`` steps of every stream from
the last first token, as this benchmark once did, made a staggered server look up to S
times faster than it was. Over HTTP the benchmark also prints each side's **throughput**,
all the tokens it sent over the wall time from the requests to its last token (what the
clients saw, time to first token included).
"""

from __future__ import annotations

import bisect
import json
import os
import re
import time


class Stream(list):
    """The ``time.perf_counter`` times one stream's chunks with a choice in them arrived
    (sorted), and ``tokens``, the completion tokens its usage chunk reported (0: none
    came). A chunk may carry more than one token: the gateway puts a behind reader's
    consecutive tokens into one chunk, so each chunk counts as ``tokens / len(self)``."""

    tokens: int = 0

    @property
    def weight(self) -> float:
        return self.tokens / len(self) if self.tokens >= len(self) > 0 else 1.0


def window(stamps: list[list[float]]) -> tuple[float, float, float]:
    """``(start, end, tokens)`` of the window where every stream of ``stamps`` (each a
    :class:`Stream` or a plain list of chunk times) was decoding: from the last stream's
    first chunk to the first stream's last, and the tokens that arrived in it (each
    stream's chunks weighted by :attr:`Stream.weight`). ``end <= start``: no such window."""
    lo, hi = max(s[0] for s in stamps), min(s[-1] for s in stamps)
    if hi <= lo:
        return lo, hi, 0.0
    return lo, hi, sum((bisect.bisect_right(s, hi) - bisect.bisect_right(s, lo)) * getattr(s, "weight", 1.0)
                       for s in stamps)


def steady_step(stamps: list[list[float]]) -> float:
    """Seconds per decode step of ``len(stamps)`` streams: the :func:`window` where every
    stream was decoding, over the steps in it (its tokens divided by the streams). Where
    no such window exists (a stream ended before another began), the whole span from the
    first chunk to the last over all the tokens after the first's (:func:`steady_share`
    says how much of a run the window held). NaN where no stream has two chunks or no
    time passed.

    Raises:
        nothing: a run that cannot be read gives NaN.
    """
    stamps = [s for s in stamps if len(s) > 1]
    if not stamps:
        return float("nan")
    lo, hi, tokens = window(stamps)
    if hi <= lo:
        lo, hi = min(s[0] for s in stamps), max(s[-1] for s in stamps)
        tokens = sum(len(s) * getattr(s, "weight", 1.0) for s in stamps) - 1
    return (hi - lo) * len(stamps) / tokens if hi > lo and tokens > 0 else float("nan")


def steady_share(stamps: list[list[float]]) -> float:
    """The share of the streams' tokens that arrived in the :func:`window` where all of
    them were decoding (0 where there is none): under about a half, a side's rate says
    little about its steady decode."""
    stamps = [s for s in stamps if len(s) > 1]
    if not stamps:
        return 0.0
    total = sum(len(s) * getattr(s, "weight", 1.0) for s in stamps)
    return window(stamps)[2] / total


def throughput(stamps: list[list[float]], began: float) -> float:
    """Tokens per second of all the streams, from ``began`` (when the requests were
    sent, ``time.perf_counter``) to the last chunk; NaN where no stream answered."""
    stamps = [s for s in stamps if s]
    if not stamps:
        return float("nan")
    last = max(s[-1] for s in stamps)
    return sum(len(s) * getattr(s, "weight", 1.0) for s in stamps) / max(last - began, 1e-9)


def request_body(model: str, tokens: list[int], decode: int, bias: dict) -> dict:
    """A streamed ``/v1/completions`` body: the text of random words (as many as
    ``tokens``, seeded by its first; mlx_lm.server takes no token ids), greedy, its
    usage asked for at the end (both servers send it)."""
    from scenarios import words

    return {"model": model, "prompt": words(len(tokens), tokens[0]), "max_tokens": decode, "temperature": 0,
            "stream": True, "logit_bias": bias, "stream_options": {"include_usage": True}}


async def http_streams(url: str, model: str, rows: list[list[int]], decode: int, bias: dict) -> tuple[list, float, list]:
    """``len(rows)`` concurrent streamed ``/v1/completions`` of ``decode`` tokens
    (:func:`request_body`) with httpx: each stream's :class:`Stream`, when the requests
    were sent (``time.perf_counter``), and the errors of the streams that failed (left
    out of the figure; see :data:`DROPS`)."""
    import asyncio

    import httpx

    stamps, failed = [], []

    async def one(c, tokens: list[int]) -> None:
        mine = Stream()
        try:
            async with c.stream("POST", "/v1/completions", json=request_body(model, tokens, decode, bias)) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if chunk.get("choices"):
                            mine.append(time.perf_counter())
                        mine.tokens = (chunk.get("usage") or {}).get("completion_tokens", mine.tokens)
            stamps.append(mine)
        except httpx.HTTPError as e:
            failed.append(repr(e))

    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        began = time.perf_counter()
        await asyncio.gather(*(one(c, r) for r in rows))
    return stamps, began, failed


CHOICE = b'"choices": [{'  # a chunk with a choice in it, as both servers write it (json.dumps' separators)
USAGE = re.compile(rb'"completion_tokens": (\d+)')
TIMEOUT = 600.0  # seconds a stream may take


async def raw_streams(url: str, model: str, rows: list[list[int]], decode: int, bias: dict) -> tuple[list, float, list]:
    """:func:`http_streams` with a client of plain sockets (asyncio streams, HTTP/1.1 and
    ``Connection: close``), which parses no JSON: a chunk's time is that of the read it
    arrived in, chunks counted by the occurrences of :data:`CHOICE`, the usage found in
    the last bytes. A stream that gets no 200, no usage or no chunk, or takes over
    :data:`TIMEOUT` seconds, counts as failed. On a machine of two cores the client
    shares them with the server: measured with ``time.process_time`` around its runs,
    this one costs 61-85 µs of CPU a token at one stream and 25-36 at sixteen, where
    httpx's line reader and ``json.loads`` cost 268-302 and 97-115
    (``benchmarks/results/host_cost_runs.md``)."""
    import asyncio
    from urllib.parse import urlsplit

    host, port = urlsplit(url).hostname, urlsplit(url).port
    stamps, failed = [], []

    async def read(tokens: list[int]) -> Stream:
        body = json.dumps(request_body(model, tokens, decode, bias)).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        mine, tail, last = Stream(), b"", b""
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(head + body)
            status = await reader.readline()
            if status.split(b" ")[1:2] != [b"200"]:
                raise OSError(f"status {status.decode(errors='replace').strip()!r}")
            while chunk := await reader.read(65536):
                now, seen = time.perf_counter(), tail + chunk
                mine.extend([now] * seen.count(CHOICE))
                tail, last = seen[-(len(CHOICE) - 1):], (last + chunk)[-4096:]
        finally:
            writer.close()
        usage = USAGE.findall(last)
        if not mine or not usage:
            raise OSError(f"{len(mine)} chunks and {'a' if usage else 'no'} usage")
        mine.tokens = int(usage[-1])
        return mine

    async def one(tokens: list[int]) -> None:
        try:
            stamps.append(await asyncio.wait_for(read(tokens), TIMEOUT))
        except (OSError, asyncio.TimeoutError) as e:
            failed.append(repr(e))

    began = time.perf_counter()
    await asyncio.gather(*(one(r) for r in rows))
    return stamps, began, failed


HTTP = ("gateway http", "gateway http, profiled", "mlx_lm.server")  # the sides over HTTP
# Why streams fail over HTTP at 16 and 32 streams (httpx ReadError); the gateway (uvicorn) completes them all.
DROPS = ("mlx_lm.server resets the connections that arrive at once beyond its listen backlog of 5 "
         "(a ThreadingHTTPServer: socketserver's request_queue_size)")


def serve_env() -> dict:
    """This process's environment for the gateway's side, with the OpenBLAS setting that
    ``serve`` gives itself when it preloads OpenBLAS (``gateway.cpu.blas.THREAD_TIMEOUT``;
    here OpenBLAS is already preloaded, so ``serve`` does not re-execute to set it): the
    gateway as users run it. A value in the environment wins, as it does for ``serve``."""
    from gateway.cpu.blas import THREAD_TIMEOUT

    return {"OPENBLAS_THREAD_TIMEOUT": THREAD_TIMEOUT, **os.environ}
