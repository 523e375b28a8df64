"""A local cluster for tests and benchmarks: ``mlx-gateway serve`` replicas, SGLang's
router (``sglang-router``) in front of them, and the cluster front
(``deploy/cluster/front.py``) in front of both, each a subprocess on a loopback port.

Used by ``tests/test_cluster.py`` and ``benchmarks/bench_cluster.py``; docs/cluster.md
explains the flags.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "gateway.cli"]
FRONT = ROOT / "deploy" / "cluster" / "front.py"

# The router flags a multi-tenant gateway cluster needs (docs/cluster.md, "Router flags"):
# - no retries and no circuit breaker: a tenant's 429 (or a 400, a 503 while draining) is an
#   answer for that tenant, not a fault of the replica. With the defaults every 429 is sent
#   5 times, and 10 of them open the replica's circuit for 60 s, for every tenant;
# - health checks every second, a replica out after 2 failed checks and back after 1 good one.
ROUTER_FLAGS = [
    "--disable-retries",
    "--disable-circuit-breaker",
    "--health-check-interval-secs", "1",
    "--health-check-timeout-secs", "2",
    "--health-failure-threshold", "2",
    "--health-success-threshold", "1",
    "--worker-startup-check-interval", "1",
    "--log-level", "warn",
]


def router_available() -> Optional[str]:
    """None when ``sglang_router`` (with its Rust router) can be imported, else why not."""
    if importlib.util.find_spec("sglang_router") is None:
        return "sglang-router is not installed (pip install 'sglang-router==0.3.2')"
    try:
        importlib.import_module("sglang_router.router")  # the Rust extension
    except Exception as e:  # pragma: no cover - a broken wheel
        return f"sglang-router's Rust router cannot be loaded: {e}"
    return None


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


class Process:
    """A subprocess writing to a log file, with its own base URL."""

    name = "process"

    def __init__(self, tmp: Path, name: str, port: Optional[int] = None):
        self.tmp = Path(tmp)
        self.name = name
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.tmp / f"{name}.log"
        self.proc: Optional[subprocess.Popen] = None
        self.client = httpx.Client(base_url=self.url, timeout=60)

    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict:
        return dict(os.environ)

    def start(self) -> "Process":
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                     cwd=ROOT)
        log.close()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_text()[-4000:]}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL, and wait for it."""
        if self.alive():
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM, and wait for the exit status."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def close(self) -> None:
        self.kill()
        self.client.close()


class Replica(Process):
    """``mlx-gateway serve --model MODEL --port PORT --log-format json ARGS``."""

    def __init__(self, tmp: Path, model: Path, *args: str, name: str = "replica", port: Optional[int] = None):
        super().__init__(tmp, name, port)
        self.model = str(model)
        self.args = list(args)

    def command(self) -> list[str]:
        return [*CLI, "serve", "--model", self.model, "--port", str(self.port), "--log-format", "json",
                *self.args]

    def health(self) -> Optional[int]:
        self.check_alive()
        try:
            return self.client.get("/health").status_code
        except httpx.TransportError:
            return None

    def wait_ready(self, timeout: float = 120) -> "Replica":
        wait_for(lambda: self.health() == 200, timeout, f"{self.name} to load its model")
        return self

    def metrics(self) -> str:
        return self.client.get("/metrics").text

    def metric(self, name: str, **labels) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        return sum(s.value for fam in text_string_to_metric_families(self.metrics()) for s in fam.samples
                   if s.name == name and labels.items() <= s.labels.items())

    def records(self) -> list[dict]:
        """The request lines of its JSON log."""
        out = []
        for line in self.log_text().splitlines():
            if line.startswith("{"):
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec.get("logger") == "mlx_gateway.requests" or "endpoint" in rec:
                    out.append(rec)
        return out

    def generated(self) -> int:
        """Requests it answered with 200 (any endpoint)."""
        return int(self.metric("mlx_gateway_requests_total", status="200"))


class Router(Process):
    """``python -m sglang_router.launch_router`` over ``workers``, with ``flags``."""

    def __init__(self, tmp: Path, workers: list[str], policy: str = "cache_aware", flags=ROUTER_FLAGS,
                 name: str = "router", port: Optional[int] = None):
        super().__init__(tmp, name, port)
        self.workers_at_start = list(workers)
        self.policy = policy
        self.flags = list(flags)
        self.metrics_port = free_port()

    def env(self) -> dict:
        return {**os.environ, "NO_COLOR": "1", "RUST_LOG_STYLE": "never"}

    def command(self) -> list[str]:
        return [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
                "--policy", self.policy, "--prometheus-host", "127.0.0.1", "--prometheus-port",
                str(self.metrics_port), *self.flags,
                *(["--worker-urls", *self.workers_at_start] if self.workers_at_start else [])]

    def workers(self) -> list[dict]:
        self.check_alive()
        try:
            r = self.client.get("/workers")
        except httpx.TransportError:
            return []
        return r.json().get("workers", []) if r.status_code == 200 else []

    def healthy(self) -> set[str]:
        return {w["url"] for w in self.workers() if w.get("is_healthy")}

    def wait_healthy(self, urls, timeout: float = 60) -> None:
        want = set(urls)
        wait_for(lambda: want <= self.healthy(), timeout, f"the router to hold {sorted(want)} as healthy")

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text


class Front(Process):
    """``python deploy/cluster/front.py --router URL``: the cluster's one address."""

    def __init__(self, tmp: Path, router_url: str, *args: str, name: str = "front", port: Optional[int] = None):
        super().__init__(tmp, name, port)
        self.router_url = router_url
        self.args = list(args)

    def command(self) -> list[str]:
        return [sys.executable, str(FRONT), "--router", self.router_url, "--host", "127.0.0.1",
                "--port", str(self.port), "--refresh", "0.5", *self.args]

    def status(self) -> dict:
        self.check_alive()
        try:
            r = self.client.get("/health")
        except httpx.TransportError:
            return {}
        return r.json()

    def wait_workers(self, n: int, timeout: float = 60) -> None:
        wait_for(lambda: len(self.status().get("workers", [])) >= n, timeout, f"the front to see {n} replicas")


class Cluster:
    """Replicas, a router and a front, closed together."""

    def __init__(self, tmp: Path, model: Path, n: int = 2, replica_args=(), policy: str = "cache_aware",
                 router_flags=ROUTER_FLAGS, front: bool = True):
        self.tmp = Path(tmp)
        self.replicas = [Replica(tmp, model, *replica_args, name=f"replica{i + 1}") for i in range(n)]
        self.router: Optional[Router] = None
        self.front: Optional[Front] = None
        self.policy = policy
        self.router_flags = router_flags
        self.with_front = front

    def start(self) -> "Cluster":
        try:
            for r in self.replicas:
                r.start()
            for r in self.replicas:
                r.wait_ready()
            urls = [r.url for r in self.replicas]
            self.router = Router(self.tmp, urls, self.policy, self.router_flags).start()
            self.router.wait_healthy(urls)
            if self.with_front:
                self.front = Front(self.tmp, self.router.url).start()
                self.front.wait_workers(len(urls))
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for p in [self.front, self.router, *self.replicas]:
            if p is not None:
                p.close()

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
