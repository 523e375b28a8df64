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
import time


def steady_step(stamps: list[list[float]]) -> float:
    """Seconds per decode step of ``len(stamps)`` streams, each stream the
    ``time.perf_counter`` times its tokens arrived (sorted): the window where every
    stream was decoding, over the steps in it (the tokens that arrived in it, each
    stream's counted, divided by the streams). Where no such window exists (a stream
    ended before another began), the whole span from the first token to the last, over
    all the tokens after the first's.

    Raises:
        ValueError: no stream has two tokens.
    """
    stamps = [s for s in stamps if len(s) > 1]
    if not stamps:
        raise ValueError("no stream has two tokens")
    lo, hi = max(s[0] for s in stamps), min(s[-1] for s in stamps)
    if hi > lo:
        tokens = sum(bisect.bisect_right(s, hi) - bisect.bisect_right(s, lo) for s in stamps)
    else:
        lo, hi = min(s[0] for s in stamps), max(s[-1] for s in stamps)
        tokens = sum(len(s) for s in stamps) - 1
    return (hi - lo) * len(stamps) / max(tokens, 1)


def throughput(stamps: list[list[float]], began: float) -> float:
    """Tokens per second of all the streams, from ``began`` (when the requests were
    sent, ``time.perf_counter``) to the last token."""
    last = max((s[-1] for s in stamps if s), default=began)
    return sum(map(len, stamps)) / max(last - began, 1e-9)


async def http_streams(url: str, model: str, rows: list[list[int]], decode: int, bias: dict) -> tuple[list, float, list]:
    """``len(rows)`` concurrent streamed ``/v1/completions`` of ``decode`` tokens, each
    prompt the text of random words (as many as its row's tokens; mlx_lm.server takes no
    token ids): the arrival times of each stream's tokens, when the requests were sent
    (``time.perf_counter``), and the errors of the streams that failed (left out of the
    figure; see :data:`DROPS`)."""
    import asyncio

    import httpx

    from scenarios import words

    stamps, failed = [], []

    async def one(c, tokens: list[int]) -> None:
        body = {"model": model, "prompt": words(len(tokens), tokens[0]), "max_tokens": decode, "temperature": 0,
                "stream": True, "logit_bias": bias}
        mine = []
        try:
            async with c.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                        mine.append(time.perf_counter())
            stamps.append(mine)
        except httpx.HTTPError as e:
            failed.append(repr(e))

    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        began = time.perf_counter()
        await asyncio.gather(*(one(c, r) for r in rows))
    return stamps, began, failed


CHOICE = b'"choices": [{'  # a chunk with a choice in it, as both servers write it (json.dumps' separators)


async def raw_streams(url: str, model: str, rows: list[list[int]], decode: int, bias: dict) -> tuple[list, float, list]:
    """:func:`http_streams` with a client of plain sockets (asyncio streams, HTTP/1.1 and
    ``Connection: close``), which parses nothing: a token's time is that of the read it
    arrived in, counted by the occurrences of :data:`CHOICE`. On a machine of two cores
    the client shares them with the server; this one costs a few microseconds a token
    where httpx's line reader and ``json.loads`` cost 70-250."""
    import asyncio
    from urllib.parse import urlsplit

    from scenarios import words

    host, port = urlsplit(url).hostname, urlsplit(url).port
    stamps, failed = [], []

    async def one(tokens: list[int]) -> None:
        body = json.dumps({"model": model, "prompt": words(len(tokens), tokens[0]), "max_tokens": decode,
                           "temperature": 0, "stream": True, "logit_bias": bias}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        mine, tail = [], b""
        try:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(head + body)
            while chunk := await reader.read(65536):
                now, seen = time.perf_counter(), tail + chunk
                mine.extend([now] * seen.count(CHOICE))
                tail = seen[-(len(CHOICE) - 1):]
            writer.close()
            stamps.append(mine)
        except OSError as e:
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
