"""SIGTERM drains a real ``mlx-gateway serve`` process, and SIGHUP reloads the tenants on
the event loop.

After SIGTERM, new generation requests get 503 and ``/health`` reports draining, a stream
that needs less than the grace period ends normally, and the streams still running when
it ends get their protocol's final error event (OpenAI chat and completions, Anthropic
Messages, Responses) and one without streaming a 503, a WARNING naming each, and
``finish_reason: "error"`` in their request records; then the process exits with status 0.

The grace period is set to 12 s (``--shutdown-grace``; the default is 30 s), and the stream
that finishes in it is sized to 4 s at the decoding rate measured in the test (with the
other streams in the batch); it takes about 6 s, since decoding slows as the sequences grow. The streams that outlive it are
unbounded for the test's purposes (tens of thousands of tokens, end of sequence suppressed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import free_port, model_path

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX signals")

CLI = [sys.executable, "-m", "gateway.cli"]
GRACE = 12.0  # --shutdown-grace of the drain test
SHORT_SECONDS = 4.0  # at the measured rate; about 6 s in fact, as decoding slows with length
LONG = 30_000  # tokens: minutes of decoding
EOS = "2"  # the end-of-sequence token of the tiny qwen3 model's own tokenizer
REASON = "server shutting down: the grace period ended"
TENANTS = 100  # new tenants per SIGHUP burst: their series are created under the metric locks
BURSTS = 3
POLL = 0.005  # seconds between two polls of the log


class Server:
    """A ``mlx-gateway serve`` subprocess whose output goes to a log file."""

    def __init__(self, tmp: Path, *args: str, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "server.log"
        self._log = open(self.log_path, "w")
        self._pos, self._records = 0, []
        self.proc = subprocess.Popen(
            [*CLI, "serve", "--model", str(model_path("qwen3")), "--port", str(self.port), "--log-format", "json",
             *args], stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, client: httpx.Client, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if client.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.1)

    def records(self) -> list[dict]:
        """The log records written so far (read incrementally: the log grows fast)."""
        with open(self.log_path) as f:
            f.seek(self._pos)
            text = f.read()
        end = text.rfind("\n") + 1
        self._pos += len(text[:end].encode())
        self._records += [json.loads(x) for x in text[:end].splitlines() if x.startswith("{")]
        return self._records


    def wait_message(self, prefix: str, n: int = 1, timeout: float = 30) -> None:
        """Wait until ``n`` log records have a message starting with ``prefix``."""
        deadline = time.monotonic() + timeout
        while True:
            if self.count(prefix) >= n:
                return
            assert self.proc.poll() is None, "server exited"
            assert time.monotonic() < deadline, f"the log never showed {n} x {prefix!r}"
            time.sleep(0.01)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._log.close()


class Stream(threading.Thread):
    """Reads one SSE stream; ``lines`` with their arrival times, ``tokens`` counts events
    carrying generated text; waiters are woken at each event."""

    def __init__(self, url: str, path: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.path, self.body = url, path, body
        self.lines: list[tuple[float, str]] = []
        self.tokens = 0
        self.ended_at: float | None = None
        self.error: BaseException | None = None
        self.cond = threading.Condition()

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.url, timeout=120) as c, \
                    c.stream("POST", self.path, json=self.body) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    with self.cond:
                        self.lines.append((time.monotonic(), line))
                        if any(k in line for k in ('"delta": {"content"', '"text": "', '"text_delta"',
                                                   '"response.output_text.delta"')):
                            self.tokens += 1
                        self.cond.notify_all()
        except BaseException as e:  # reported by the test
            self.error = e
        finally:
            with self.cond:
                self.ended_at = time.monotonic()
                self.cond.notify_all()

    def wait_tokens(self, n: int, timeout: float = 60) -> float:
        """Wait until ``n`` token events came; returns when."""
        with self.cond:
            assert self.cond.wait_for(lambda: self.tokens >= n or self.ended_at is not None, timeout), \
                f"{self.path}: {self.tokens} tokens"
            assert self.tokens >= n, (self.path, self.error, self.lines[-3:])
            return time.monotonic()

    def events(self) -> list[str]:
        return [x for _, x in self.lines if x]


def long_streams(url: str) -> dict[str, Stream]:
    chat = [{"role": "user", "content": "tell me a very long story"}]
    bias = {EOS: -100}
    return {
        "chat": Stream(url, "/v1/chat/completions", {"messages": chat, "max_tokens": LONG, "stream": True,
                                                     "logit_bias": bias}),
        "completions": Stream(url, "/v1/completions", {"prompt": "once upon a time", "max_tokens": LONG,
                                                       "stream": True, "logit_bias": bias}),
        "messages": Stream(url, "/v1/messages", {"messages": chat, "max_tokens": LONG, "stream": True,
                                                 "logit_bias": bias}),
        "responses": Stream(url, "/v1/responses", {"input": "tell me a very long story",
                                                   "max_output_tokens": LONG, "stream": True}),
    }


def check_final_error(api: str, events: list[str]) -> None:
    """The stream of ``api`` ends with its protocol's error event carrying the reason."""
    if api in ("chat", "completions"):
        assert events[-1] == "data: [DONE]", events[-3:]
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["message"] == REASON and error["type"] == "service_unavailable"
    elif api == "messages":
        assert events[-2] == "event: error", events[-3:]
        body = json.loads(events[-1].removeprefix("data: "))
        assert body["type"] == "error" and body["error"] == {"type": "overloaded_error", "message": REASON}
    else:
        assert events[-2] == "event: response.failed", events[-3:]
        response = json.loads(events[-1].removeprefix("data: "))["response"]
        assert response["status"] == "failed" and response["error"]["message"] == REASON


def test_sigterm_lets_short_streams_finish_and_cuts_long_ones_with_a_final_error_event(tmp_path):
    started = time.monotonic()
    server = Server(tmp_path, "--max-tokens-limit", "100000", "--shutdown-grace", str(GRACE))
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            server.wait_ready(c)
            longs = long_streams(server.url)
            for s in longs.values():
                s.start()
            unstreamed: list[httpx.Response] = []
            plain = threading.Thread(target=lambda: unstreamed.append(httpx.post(
                server.url + "/v1/chat/completions", timeout=120, json={
                    "messages": [{"role": "user", "content": "no stream"}], "max_tokens": LONG,
                    "logit_bias": {EOS: -100}})), daemon=True)
            plain.start()
            for s in longs.values():
                s.wait_tokens(2)
            # The decoding rate with these streams in the batch sizes the short stream.
            t0 = longs["chat"].wait_tokens(longs["chat"].tokens + 1)
            n0 = longs["chat"].tokens
            t1 = longs["chat"].wait_tokens(n0 + 50)
            rate = (longs["chat"].tokens - n0) / (t1 - t0)
            short = Stream(server.url, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "a short one"}], "stream": True,
                "max_tokens": max(10, int(rate * SHORT_SECONDS)), "logit_bias": {EOS: -100}})
            short.start()
            short.wait_tokens(1)

            os.kill(server.proc.pid, signal.SIGTERM)
            sigterm = time.monotonic()
            small = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            deadline = sigterm + 5
            while (r := c.post("/v1/chat/completions", json=small)).status_code != 503:
                assert r.status_code == 200 and time.monotonic() < deadline, r.text
            assert r.json()["error"]["code"] == "shutting_down" and int(r.headers["retry-after"]) > 0
            health = c.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "draining"

            short.join(GRACE + 5)
            assert short.error is None and short.ended_at is not None
            events = short.events()
            assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)
            assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
            assert sigterm < short.ended_at < sigterm + GRACE  # it ran on after SIGTERM, and finished

            for api, s in longs.items():
                s.join(GRACE + 15)
                assert s.error is None and s.ended_at is not None, (api, s.error)
                assert s.ended_at >= sigterm + GRACE - 0.5, (api, s.ended_at - sigterm)
                check_final_error(api, s.events())
            plain.join(15)
            assert unstreamed and unstreamed[0].status_code == 503, unstreamed
            assert unstreamed[0].json()["error"]["message"] == REASON
        assert server.proc.wait(timeout=20) == 0
        exited = time.monotonic()
    finally:
        server.close()

    records = server.records()
    cut = {r["message"].split()[2] for r in records if r["level"] == "warning"
           and r["message"].startswith("cutting request ") and REASON in r["message"]}
    requests = [r for r in records if r["logger"] == "mlx_gateway.requests"]
    cut_records = [r for r in requests if r.get("request_id") in cut]
    assert sorted((r["endpoint"], r["stream"]) for r in cut_records) == [
        ("chat", False), ("chat", True), ("completions", True), ("messages", True), ("responses", True)]
    for r in cut_records:
        assert r["finish_reason"] == "error" and r["error"] == REASON, r
    finished = [r for r in requests if r["stream"] and r.get("finish_reason") == "length"]
    assert len(finished) == 1 and "error" not in finished[0]
    assert any(r["status"] == 503 and r["endpoint"] == "chat" for r in requests)
    print(f"\nstartup+streams {sigterm - started:.1f} s, short stream {max(10, int(rate * SHORT_SECONDS))} "
          f"tokens at {rate:.1f} tokens/s ended {short.ended_at - sigterm:.1f} s after SIGTERM, "
          f"long streams cut {min(s.ended_at for s in longs.values()) - sigterm:.1f} s after it, "
          f"exit {exited - sigterm:.1f} s after it, test {exited - started:.1f} s")


def test_an_idle_server_exits_at_once_on_sigterm(tmp_path):
    server = Server(tmp_path)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            server.wait_ready(c)
            assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        sigterm = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=15) == 0
        assert time.monotonic() - sigterm < 10  # not the 30-s grace period
    finally:
        server.close()
    assert any("SIGTERM: draining" in r["message"] for r in server.records())


def test_sighup_bursts_reload_on_the_loop_while_metrics_are_scraped(tmp_path):
    """Bursts of SIGHUP, while /metrics is scraped and requests run, reload the tenants and
    never deadlock. A ``signal.signal`` handler runs inside whatever the loop thread was
    doing, even inside the previous reload while it holds a prometheus_client metric lock
    (creating the new tenants' series), and re-entering that lock hangs the server."""
    from gateway.tenancy.tenants import hash_key

    tenants = tmp_path / "tenants.toml"
    key = "key-of-app"

    def write(prefix: str) -> None:
        rest = "".join(f'[tenants.{prefix}{i}]\nkey_sha256 = ["{hash_key(f"{prefix}{i}")}"]\n'
                       for i in range(TENANTS))
        tenants.write_text(f'[tenants.app]\nkey_sha256 = ["{hash_key(key)}"]\n{rest}')

    write("first")
    server = Server(tmp_path, "--tenants", str(tenants))
    stop = threading.Event()
    failures: list[str] = []

    def hammer(path: str, **kw) -> None:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            while not stop.is_set():
                try:
                    r = c.request("POST" if "json" in kw else "GET", path, **kw)
                    if r.status_code != 200:
                        failures.append(f"{path}: {r.status_code}")
                except httpx.HTTPError as e:
                    failures.append(f"{path}: {e!r}")
                    return

    workers = [threading.Thread(target=hammer, args=("/metrics",), daemon=True),
               threading.Thread(target=hammer, args=("/v1/completions",), daemon=True, kwargs={
                   "json": {"prompt": "hi", "max_tokens": 3}, "headers": {"Authorization": f"Bearer {key}"}})]
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            server.wait_ready(c)
            for w in workers:
                w.start()
            for burst in range(BURSTS):
                write(f"b{burst}x")
                # A SIGHUP at every poll of the log until the server has reloaded, so that
                # signals keep coming while the reload runs. (Not faster: a flood could fill
                # the event loop's signal pipe, which CPython 3.11 does not survive.)
                # Until a reload has read this file: one that began before the write may
                # end after it, having read the previous one.
                deadline = time.monotonic() + 30
                while True:
                    metrics = c.get("/metrics", timeout=30)
                    assert metrics.status_code == 200
                    if f'tenant="b{burst}x0"' in metrics.text:
                        break
                    assert server.proc.poll() is None and time.monotonic() < deadline, "no reload: it hangs"
                    os.kill(server.proc.pid, signal.SIGHUP)
                    time.sleep(POLL)
            stop.set()
            for w in workers:
                w.join(30)
            assert not failures, failures[:5]
            assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                          headers={"Authorization": f"Bearer {key}"}).status_code == 200
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=20) == 0
    finally:
        stop.set()
        server.close()
