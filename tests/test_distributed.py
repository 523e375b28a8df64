"""One model across two ranks on localhost (``mlx.launch --backend ring -n 2``).

The gateway runs under ``mlx.launch`` with a tiny random-weight model split by mlx-lm
(tensor parallel for qwen3, ``--pipeline`` for qwen3_5); the same requests go to a
one-process gateway on the same model directory. Greedy outputs must be equal (exactly:
on these models tensor parallel agrees token for token too), a shared long prefix must
hit rank 0's prefix cache (the followers' caches restore the same prefix), and a
concurrent pair decodes in one batch. A rank killed mid-request must end the request and
stop rank 0 with a clear error, never hang. See docs/cluster.md, "One model across
machines".
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import model_path

# bytes written to mlx.launch's stdin: more than a rank's stdin pipe holds (64 KiB on Linux, 16-64 KiB on macOS)
LAUNCH_STDIN_FILL = 1 << 18
LAUNCH = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
GATEWAY = shutil.which("mlx-gateway") or str(Path(sys.executable).parent / "mlx-gateway")

pytestmark = pytest.mark.skipif(not (Path(LAUNCH).exists() and Path(GATEWAY).exists()),
                                reason="mlx.launch or mlx-gateway is not installed")

LONG = " ".join(f"word{i} alpha beta" for i in range(60))  # about 600 tokens


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A gateway subprocess (one process, or two ranks under mlx.launch), its log in a file."""

    def __init__(self, tmp: Path, name: str, model: Path, ranks: int, *extra: str):
        self.port = _free_port()
        self.model = str(model)
        self.log_path = tmp / f"{name}.log"
        serve = [GATEWAY, "serve", "--model", self.model, "--port", str(self.port), "--shutdown-grace", "2", *extra]
        launch = [LAUNCH, "--backend", "ring", "--hosts", "127.0.0.1", "-n", str(ranks), "--"]
        cmd = [*launch, *serve] if ranks > 1 else serve
        self._log = open(self.log_path, "wb")
        # stdin a pipe that stays open: mlx.launch relays its stdin to the ranks and polls
        # /dev/null (always readable) in a busy loop
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.PIPE,
                                     start_new_session=True)
        if ranks > 1:
            # ... and it waits in select() for each rank's stdin pipe to be writable, which an
            # empty pipe always is: a core and more of busy loop while the ranks idle, which
            # slowed this module's other tests 2-3x. Filled with bytes the ranks never read,
            # the pipes stop being writable (docs/cluster.md).
            threading.Thread(target=self._fill_stdin, daemon=True).start()

    def _fill_stdin(self) -> None:
        try:
            self.proc.stdin.write(bytes(LAUNCH_STDIN_FILL))
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            pass  # mlx.launch ended

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.3)
        raise AssertionError(f"server not ready in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def ranks(self) -> dict[int, int]:
        """Rank -> pid of the processes mlx.launch started."""
        out = {}
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                cmdline = (d / "cmdline").read_bytes()
                env = (d / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"--port\0{self.port}\0".encode() not in cmdline or b"mlx.launch" in cmdline:
                continue
            rank = next((int(e.split(b"=")[1]) for e in env if e.startswith(b"MLX_RANK=")), None)
            if rank is not None:
                out[rank] = int(d.name)
        return out

    def chat(self, content: str, max_tokens: int = 16, timeout: float = 60.0, stop: list | None = None,
             priority: str | None = None, **extra):
        body = {"model": self.model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                "temperature": 0, **extra}
        if stop:
            body["stop"] = stop
        if priority:
            body["priority"] = priority
        body = json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/chat/completions", body,
                                     {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            d = json.load(r)
        cached = (d["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return d["choices"][0]["message"]["content"], cached

    def chat_stream(self, content: str, max_tokens: int, first: threading.Event,
                    priority: str = "standard") -> tuple[str, int]:
        """A streamed chat completion; ``first`` is set when its first token arrives."""
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": content}],
                           "max_tokens": max_tokens, "temperature": 0, "stream": True,
                           "priority": priority}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/chat/completions", body,
                                     {"content-type": "application/json"})
        text = ""
        with urllib.request.urlopen(req, timeout=60) as r:
            for line in r:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices", []):
                    delta = choice.get("delta", {}).get("content")
                    if delta:
                        text += delta
                        first.set()
        first.set()
        return text, 0

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            return r.read().decode()

    def stop(self) -> None:
        """SIGTERM to the ranks (rank 0 drains, then tells the others to stop), as to one
        process; the whole group if that does not end it."""
        if self.proc.poll() is None:
            for pid in self.ranks().values() or [self.proc.pid]:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(10)
        self._log.close()
        if self.proc.stdin is not None:
            self.proc.stdin.close()


def _with_a_pause(server: Server) -> dict:
    """A batch-class request with a long prompt, then a standard one while it prefills: the
    batch row's prefill is paused (its cache kept) and resumed after."""
    out: dict = {}

    def batch() -> None:
        out["batch"] = server.chat(" ".join(f"word{i} gamma delta" for i in range(800)), 8, priority="batch")

    t = threading.Thread(target=batch)
    t.start()
    time.sleep(0.4)
    out["standard"] = server.chat("a quick one", 8)
    t.join()
    return out


def _workload(server: Server, pause: bool = False) -> dict:
    """The same requests for every server: a short one, the same ended by a stop string,
    two sharing a long prefix (the second restores it), a grammar-constrained one with
    logprobs, a sampled one, and a concurrent pair."""
    out = {"short": server.chat("hello there, how are you", 8)}
    text = out["short"][0]
    if len(text) > 6:  # a stop string ends it early: the gateway cancels the row (a "stop")
        out["stopped"] = server.chat("hello there, how are you", 8, stop=[text[4:7]])
    out["prefix1"] = server.chat(LONG + " first question?", 8)
    out["prefix2"] = server.chat(LONG + " second question!", 8)
    # grammar-constrained (the grammar lives on rank 0; the followers get its tokens), with logprobs
    out["schema"] = server.chat("a point please", 24, response_format={"type": "json_schema", "json_schema": {
        "name": "p", "schema": POINT, "strict": True}}, logprobs=True, top_logprobs=2)
    # sampled: rank 0 samples; every rank feeds its tokens
    out["sampled"] = server.chat("pick some words", 8, temperature=0.9, seed=7)
    # A concurrent pair: the second arrives while the first decodes, and joins its batch.
    pair: dict = {}
    first = threading.Event()

    def one() -> None:
        pair["pair1"] = server.chat_stream("tell me a story about cats", 48, first)

    t = threading.Thread(target=one)
    t.start()
    first.wait(30)
    pair["pair2"] = server.chat("list some numbers please", 8)
    t.join()
    out.update(pair)
    if pause:
        out.update(_with_a_pause(server))
    return out


POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "ok": {"type": "boolean"}}, "required": ["x", "ok"]}


def _max_decode_batch(metrics: str) -> int:
    """The largest decode batch the histogram saw (its smallest bucket holding every step)."""
    buckets = [(float(m.group(1)), float(m.group(2))) for m in re.finditer(
        r'mlx_gateway_decode_batch_size_bucket\{[^}]*le="([^"+]+)"[^}]*\} ([0-9.e+]+)', metrics)]
    count = max((c for _, c in buckets), default=0)
    return int(min((le for le, c in buckets if c >= count), default=0))


@pytest.fixture(scope="module")
def tensor_cluster(tmp_path_factory):
    """Two ranks serving tiny qwen3 split tensor parallel (the last test kills a rank)."""
    cluster = Server(tmp_path_factory.mktemp("tensor"), "cluster", model_path("qwen3", None), 2)
    yield cluster
    cluster.stop()


def _check_against_one_process(tmp_path: Path, cluster: Server, model: Path, extra: tuple = (),
                               pause: bool = False) -> float:
    """Run :func:`_workload` on ``cluster`` and on a one-process gateway, compare; the
    evictions rank 0's prefix cache made."""
    # plain decoding, as the split model's (speculation is refused across ranks): this compares
    # the split alone (tests/test_speculative*.py compare speculation with plain decoding)
    single = Server(tmp_path, "single", model, 1, "--speculative", "off", *extra)
    try:
        cluster.wait_ready()
        single.wait_ready()
        got = _workload(cluster, pause)
        want = _workload(single, pause)
    finally:
        single.stop()
    agree = sum(got[k][0] == want[k][0] for k in want)
    print(f"{Path(model).name}: {agree}/{len(want)} greedy completions of the split model equal to one process")
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in want.items()}  # greedy texts
    point = json.loads(got["schema"][0])
    assert set(point) == {"x", "ok"} and 0 <= point["x"] <= 9
    # cached tokens of the requests sent one at a time (the pair's depend on timing)
    one_at_a_time = [k for k in ("short", "stopped", "prefix1", "prefix2") if k in got]
    # "stopped" repeats "short" exactly: one process restores its whole prompt and samples its
    # first token from the logits it kept (scheduler/batch/first_tokens.py); ranks keep none (each
    # would have to start the row alike) and compute its last prompt token
    whole = {"stopped"}
    assert [got[k][1] + (k in whole) for k in one_at_a_time] == [want[k][1] for k in one_at_a_time]
    assert got["prefix2"][1] >= 256  # the long prefix came from the prefix cache
    metrics = cluster.metrics()
    assert _max_decode_batch(metrics) >= 2  # the concurrent pair decoded together
    evicted = sum(float(v) for v in
                  re.findall(r'mlx_gateway_prompt_cache_evictions_total\{[^}]*\} ([0-9.e+]+)', metrics))
    print(f"{evicted:g} prefix-cache evictions on rank 0")
    if pause:  # usually: the standard request arrives while the batch prompt's first chunk runs
        paused = re.findall(r'mlx_gateway_prefill_pauses_total\{[^}]*priority="2"\} ([0-9.]+)', metrics)
        print(f"batch-class prefill paused {paused[0] if paused else '?'} time(s) on the split model")
    assert "rank 1 of 2 serves its part" in cluster.log()
    assert "Traceback" not in cluster.log()
    return evicted


def test_tensor_parallel_matches_one_process(tmp_path, tensor_cluster):
    _check_against_one_process(tmp_path, tensor_cluster, model_path("qwen3", None), pause=True)


def test_a_decoding_row_paused_for_a_better_class_resumes_on_every_rank(tmp_path):
    """One decode slot: a batch-class stream decoding when a standard request comes is
    taken out of the decode batch on both ranks (its state kept) and goes on after; the
    texts equal one process's with the same flags."""
    model = model_path("qwen3", None)
    flags = ("--prompt-concurrency", "1", "--decode-concurrency", "1")

    def run(server: Server) -> dict:
        server.wait_ready()
        out, first = {}, threading.Event()
        # long enough (about 1.5 s alone here) that the standard request comes while it
        # decodes even on a loaded machine: 64 tokens (0.2 s) once ended before it came
        t = threading.Thread(target=lambda: out.update(stream=server.chat_stream(
            "tell me a long story about cats", 400, first, priority="batch")))
        t.start()
        assert first.wait(30)
        out["standard"] = server.chat("a quick one", 8)
        t.join()
        paused = re.findall(r'mlx_gateway_decode_pauses_total\{[^}]*priority="2"\} ([0-9.]+)', server.metrics())
        return {"texts": out, "paused": float(paused[0])}

    cluster = Server(tmp_path, "cluster", model, 2, *flags)
    try:
        got = run(cluster)
        assert "Traceback" not in cluster.log()
    finally:
        cluster.stop()
    single = Server(tmp_path, "single", model, 1, *flags)
    try:
        want = run(single)
    finally:
        single.stop()
    assert got["paused"] >= 1 and want["paused"] >= 1
    assert got["texts"] == want["texts"]


def test_pipeline_matches_one_process(tmp_path):
    model = model_path("qwen3_5", None)  # mlx-lm has a pipeline split for qwen3_5, not for qwen3
    # Its caches cannot be trimmed: prefixes restore at checkpoints. Few entries: inserts
    # evict, and the followers must drop the snapshots rank 0 drops.
    extra = ("--checkpoint-every", "256", "--prompt-cache-size", "4")
    cluster = Server(tmp_path, "cluster", model, 2, "--pipeline", *extra)
    try:
        assert _check_against_one_process(tmp_path, cluster, model, extra) > 0
    finally:
        cluster.stop()
    # a graceful stop: rank 0 drains, then the follower leaves when told
    assert cluster.proc.returncode == 0, cluster.log()
    assert "rank 1: rank 0 stopped; leaving" in cluster.log()


def test_a_load_that_fails_on_rank_0_stops_every_rank(tmp_path):
    """A memory budget the weights do not fit: rank 0's load fails after the split, while
    rank 1 waits in the load's collectives; the launch ends with rank 0's reason."""
    cluster = Server(tmp_path, "no-room", model_path("qwen3", None), 2, "--memory-budget", "64K")
    try:
        cluster.proc.wait(60)
    except subprocess.TimeoutExpired:
        cluster.stop()
        raise AssertionError("the ranks kept running after rank 0's load failed:\n" + cluster.log()[-3000:])
    finally:
        cluster.stop()
    # (mlx.launch's own status is 0 whatever its ranks' were; rank 0's message says why)
    assert re.search(r"^mlx-gateway: loading the model failed on rank 0: .*memory budget", cluster.log(),
                     re.M), cluster.log()[-3000:]


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the ranks' processes in /proc")
def test_a_lost_rank_stops_the_server(tensor_cluster):
    """Rank 1 is killed while a request decodes: the request ends with a 503 naming the
    lost rank, rank 0 logs why and exits (status 1, its message last), well within bounds."""
    cluster = tensor_cluster
    cluster.wait_ready()
    ranks = cluster.ranks()
    assert set(ranks) == {0, 1}, ranks
    result: dict = {}

    def long_request() -> None:
        try:
            result["reply"] = cluster.chat("a very long answer please", 30000, timeout=60)
        except urllib.error.HTTPError as e:
            result["status"] = e.code
            result["body"] = e.read().decode(errors="replace")
        except OSError as e:  # the connection closed
            result["error"] = repr(e)

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(2.0)  # decoding by now
    os.kill(ranks[1], signal.SIGKILL)
    killed = time.monotonic()
    t.join(30)
    assert not t.is_alive(), "the request in flight hung"
    assert result.get("status") == 503 and "rank" in result.get("body", ""), (result, cluster.log()[-3000:])
    cluster.proc.wait(30)
    assert time.monotonic() - killed < 15
    log = cluster.log()
    assert "distributed serving stopped on rank 0 of 2" in log, log
    assert "connection to a peer was lost" in log, log
    assert re.search(r"^mlx-gateway: .*(rank|peer).*", log, re.M), log  # rank 0's exit message (status 1)
