"""No silent hang: a real gateway process whose engine loop stalls or crashes (injected
through MLX_GATEWAY_INJECT_FAULT, scheduler/batch/faults.py) says so on /health and /metrics,
logs every thread's stack, and with --on-engine-fault exit ends the requests in flight
with a clear error and exits with the status the service units restart on."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import httpx

from prometheus_client.parser import text_string_to_metric_families

from conftest import free_port, model_path, wait_until
from gateway.engine_fault import EXIT_CODE

CLI = [sys.executable, "-m", "gateway.cli"]
STALL_FLOOR = "5"  # --engine-stall-seconds: above any step of the tiny model, first compiles included


class Gateway:
    """``mlx-gateway serve`` in a subprocess, its output collected as it comes."""

    def __init__(self, fault: str, *flags: str):
        self.port = free_port()
        env = dict(os.environ, MLX_GATEWAY_INJECT_FAULT=fault)
        self.proc = subprocess.Popen(
            [*CLI, "serve", "--model", str(model_path("qwen3")), "--port", str(self.port),
             "--engine-stall-seconds", STALL_FLOOR, *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.output: list[str] = []
        self.reader = threading.Thread(target=lambda: self.output.extend(self.proc.stdout), daemon=True)
        self.reader.start()
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=120)

        def healthy() -> bool:
            assert self.proc.poll() is None, "the server exited:\n" + self.text
            try:
                return self.client.get("/health").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, 120, "the server to answer /health", interval=0.2)

    @property
    def text(self) -> str:
        return "".join(self.output)

    def metric(self, name: str, **labels) -> float:
        return sample_text(self.client.get("/metrics").text, name, **labels)

    def close(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.reader.join(10)


def sample_text(text: str, name: str, **labels) -> float:
    """The sum of the samples ``name`` with ``labels`` in a /metrics page."""
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and labels.items() <= s.labels.items())


BODY = {"messages": [{"role": "user", "content": "tell me a story"}],
        "max_tokens": 8, "temperature": 0}


def in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except Exception as e:  # the connection dropped: the test says so
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def streamed(client: httpx.Client) -> str:
    with client.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as r:
        return f"{r.status_code}\n" + "\n".join(r.iter_lines())


def test_a_stall_turns_health_to_stalled_logs_the_stacks_and_clears(tmp_path):
    trigger = tmp_path / "stall"
    gw = Gateway(f"stall:{trigger}")
    try:
        assert gw.client.post("/v1/chat/completions", json=BODY).status_code == 200
        assert gw.metric("mlx_gateway_engine_stalled") == 0
        assert gw.metric("mlx_gateway_engine_stall_bound_seconds") == float(STALL_FLOOR)
        trigger.touch()
        waiter, answer = in_thread(lambda: gw.client.post("/v1/chat/completions", json=BODY))
        stalled = wait_until(lambda: (h := gw.client.get("/health")).status_code == 503 and h.json(), 30,
                             "/health to report the stall", interval=0.2)
        assert stalled["status"] == "stalled" and "engine step has run for" in stalled["detail"], stalled
        assert gw.metric("mlx_gateway_engine_stalled") == 1
        assert gw.metric("mlx_gateway_engine_faults_total", kind="stalled") == 1
        wait_until(lambda: "the stack of every thread" in gw.text, 10, "the stacks in the log")
        assert gw.text.count("mlx_gateway.engine: engine loop stalled") == 1  # once per stall
        assert "inject_fault" in gw.text and "engine-watchdog" in gw.text  # the stalled frame, every thread
        assert gw.proc.poll() is None  # --on-engine-fault serve (the default): the process stays
        trigger.unlink()
        waiter.join(60)
        assert answer["value"].status_code == 200  # the stalled request goes on once the step ends
        wait_until(lambda: gw.client.get("/health").status_code == 200, 10, "/health to clear")
        assert gw.metric("mlx_gateway_engine_stalled") == 0
        assert gw.metric("mlx_gateway_engine_faults_total", kind="stalled") == 1
    finally:
        gw.close()


def check_exit(gw: Gateway, trigger, said: str) -> None:
    """Fire the fault under two requests (one streamed): both end with a 503 naming it, and
    the process exits with EXIT_CODE."""
    trigger.touch()
    plain, plain_out = in_thread(lambda: gw.client.post("/v1/chat/completions", json=BODY))
    stream, stream_out = in_thread(lambda: streamed(gw.client))
    assert gw.proc.wait(60) == EXIT_CODE, gw.text
    plain.join(10)
    stream.join(10)
    r = plain_out["value"]
    assert r.status_code == 503 and said in r.json()["error"]["message"], r.text
    text = stream_out["value"]
    assert (text.startswith("503") or '"error"' in text) and said in text, text
    assert f"exiting with status {EXIT_CODE}" in gw.text


def test_a_stall_with_exit_ends_requests_and_exits_for_a_restart(tmp_path):
    trigger = tmp_path / "stall"
    gw = Gateway(f"stall:{trigger}", "--on-engine-fault", "exit")
    try:
        check_exit(gw, trigger, "the model engine stalled")
        assert "the stack of every thread" in gw.text
    finally:
        gw.close()


def test_a_crash_with_exit_ends_requests_and_exits_for_a_restart(tmp_path):
    trigger = tmp_path / "crash"
    gw = Gateway(f"crash:{trigger}", "--on-engine-fault", "exit")
    try:
        check_exit(gw, trigger, "InjectedFault")
        assert "engine thread died" in gw.text
    finally:
        gw.close()


def test_a_crash_by_default_keeps_the_process_with_health_dead(tmp_path):
    trigger = tmp_path / "crash"
    gw = Gateway(f"crash:{trigger}")
    try:
        trigger.touch()
        r = gw.client.post("/v1/chat/completions", json=BODY)
        assert r.status_code == 503 and "InjectedFault" in r.json()["error"]["message"], r.text
        h = gw.client.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "dead"
        wait_until(lambda: gw.metric("mlx_gateway_engine_faults_total", kind="dead") == 1, 10, "the dead metric")
        assert gw.proc.poll() is None
    finally:
        gw.close()


def test_the_bound_follows_the_measured_steps_and_waiting_work_without_a_step_is_a_stall():
    """The watchdog's rules on their own, on a loop object that only reports its state."""
    from types import SimpleNamespace

    from scheduler.engine.watchdog import FACTOR, Heartbeat, Watchdog

    loop = SimpleNamespace(beat=Heartbeat(), alive=True, stopping=False, error=None, waiting_work=False)
    faults = []
    dog = Watchdog(loop, floor=5.0, on_fault=lambda kind, why: faults.append((kind, why)))
    assert dog.bound() == 5.0
    loop.beat.durations.extend([0.01, 2.0, 0.02])
    assert dog.bound() == FACTOR * 2.0  # ten times the longest recent step, above the floor
    t = loop.beat.last
    loop.waiting_work = True
    dog.check(t + 1)  # work seen: its clock starts
    dog.check(t + 15)
    assert loop.beat.stalled is None and not faults  # 14 s < 20 s
    dog.check(t + 22)
    assert loop.beat.stalled and "without an engine step" in loop.beat.stalled
    assert faults == [("stalled", loop.beat.stalled)]
    dog.check(t + 30)
    assert len(faults) == 1  # once per stall
    loop.beat.begin()
    loop.beat.end()
    dog.check(loop.beat.last + 0.5)
    assert loop.beat.stalled is None  # a step happened: the stall clears
    loop.stopping = True
    loop.beat.begin()
    dog.check(loop.beat.last + 100)
    assert loop.beat.stalled is None  # a stop's last turn (writing the caches to disk) is no stall
    loop.error = RuntimeError("boom")
    dog.check(loop.beat.last + 101)
    dog.check(loop.beat.last + 102)
    assert faults[1:] == [("dead", "the engine loop died: RuntimeError('boom')")]
