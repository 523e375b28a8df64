"""Stored responses that outlive a gateway: ``mlx-gateway serve`` subprocesses serving a real
tiny model, driven by the official ``openai`` SDK.

- One gateway on the default store (SQLite in the data directory) and a disk tier of the
  prefix cache: a chain of responses goes on across a SIGTERM and a SIGKILL, each next turn
  from ``previous_response_id`` with its prompt restored from the disk tier; ``GET`` and
  ``input_items`` after each restart; a response is readable as soon as its final stream
  event arrives; ``store: false`` leaves nothing in the file; another tenant's ids are 404s.
- Two gateways sharing a real Redis: a chain started on one continues on the other, also
  once the first is killed; a Redis that goes away turns into ``store: false`` and 503s.
"""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from conftest import free_port, model_path, sample, wait_until
from gateway.tenancy.tenants import hash_key
from redis_server import RedisServer, require_redis

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")

KEYS = {"alice": "mgw-test-durable-alice", "bob": "mgw-test-durable-bob"}
DISK_READS = "mlx_gateway_prompt_cache_disk_reads_total"
WORDS = ("the model cache token prompt server batch request tenant prefix memory apple code agent "
         "browser extension stream answer question system user assistant reason think water").split()


def text(seed: int, n: int) -> str:
    return " ".join(WORDS[(seed * 7 + k * 3 + k * k) % len(WORDS)] for k in range(n))


class Served:
    """An ``mlx-gateway serve`` subprocess on a free port, its output in ``tmp/NAME.log``."""

    def __init__(self, tmp: Path, *args: str, name: str):
        self.port, self.model = free_port(), str(model_path("qwen3"))
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"{name}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--model", self.model,
                                      "--port", str(self.port), *args], stdout=self._log, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=self.url, timeout=120)

    def wait_ready(self) -> "Served":
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"the gateway exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
            try:
                return self.http.get("/health").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(ready, 120, "the gateway to load its model", interval=0.05)
        return self

    def sdk(self, tenant: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEYS[tenant], max_retries=0, timeout=120)

    def metric(self, name: str, **labels) -> float:
        return sample(self.http.get("/metrics").text, name, **labels)

    def signal(self, sig: int) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(60)

    def close(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._log.close()


@pytest.fixture
def serve(tmp_path):
    """``serve(*args, name=...)``: a started gateway with the test tenants; all killed at the end."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text("".join(f'[tenants.{n}]\nkey_sha256 = ["{hash_key(k)}"]\n\n' for n, k in KEYS.items()))
    started: list[Served] = []

    def start(*args: str, name: str) -> Served:
        g = Served(tmp_path, "--tenants", str(tenants), "--max-tokens", "8", *args, name=name)
        started.append(g)
        return g

    yield start
    for g in started:
        g.close()


def ask(sdk: openai.OpenAI, model: str, prompt: str, previous=None, **kw):
    return sdk.responses.create(model=model, input=prompt, previous_response_id=previous, temperature=0,
                                max_output_tokens=6, **kw)


def cached(r) -> int:
    return r.usage.input_tokens_details.cached_tokens


def chain_texts(sdk: openai.OpenAI, rid: str) -> list[tuple[str, str]]:
    """(role, text) of the input items of ``rid``, oldest first."""
    return [(it.role, it.content[0].text) for it in sdk.responses.input_items.list(rid, order="asc")]


def assert_foreign(sdk: openai.OpenAI, model: str, rid: str) -> None:
    """Every way ``sdk``'s tenant could reach the response ``rid`` of another is a 404."""
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(rid)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.input_items.list(rid)
    with pytest.raises(openai.NotFoundError):
        ask(sdk, model, "hi", previous=rid)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.delete(rid)


def stored_ids(path: Path) -> dict[str, set[str]]:
    """Tenant -> ids in the SQLite store file at ``path``."""
    with sqlite3.connect(path) as c:
        rows = c.execute("SELECT tenant, id FROM responses").fetchall()
    out: dict[str, set[str]] = {}
    for tenant, rid in rows:
        out.setdefault(tenant, set()).add(rid)
    return out


def test_a_chain_goes_on_across_sigterm_and_sigkill(tmp_path, serve, monkeypatch):
    data = tmp_path / "data"
    monkeypatch.setenv("MLX_GATEWAY_DATA_DIR", str(data))  # the default store: SQLite in here
    flags = ("--prompt-cache-dir", str(tmp_path / "prompt-cache"))
    prompts = [text(1, 60), text(2, 12), text(3, 12)]

    g = serve(*flags, name="first").wait_ready()
    alice = g.sdk("alice")
    first = None
    for ev in alice.responses.create(model=g.model, input=prompts[0], temperature=0, max_output_tokens=6,
                                     stream=True):
        if ev.type in ("response.completed", "response.incomplete"):
            first = ev.response
            # Stored before its final event was sent: readable while the stream is still open.
            assert alice.responses.retrieve(first.id).output_text == first.output_text
    assert first is not None and first.store is True
    unstored = ask(alice, g.model, "not to be kept", store=False)
    assert unstored.store is False
    assert g.signal(signal.SIGTERM) == 0, g.log_path.read_text()

    g = serve(*flags, name="after-sigterm").wait_ready()
    alice, bob = g.sdk("alice"), g.sdk("bob")
    assert alice.responses.retrieve(first.id).model_dump() == first.model_dump()
    assert chain_texts(alice, first.id) == [("user", prompts[0])]
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(unstored.id)
    assert_foreign(bob, g.model, first.id)
    second = ask(alice, g.model, prompts[1], previous=first.id)
    assert cached(second) > 0 and g.metric(DISK_READS, outcome="hit") >= 1, second.usage
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert g.signal(signal.SIGKILL) == -signal.SIGKILL

    g = serve(*flags, name="after-sigkill").wait_ready()
    alice, bob = g.sdk("alice"), g.sdk("bob")
    assert alice.responses.retrieve(second.id).model_dump() == second.model_dump()
    assert chain_texts(alice, second.id) == [("user", prompts[0]), ("assistant", first.output_text),
                                             ("user", prompts[1])]
    assert_foreign(bob, g.model, second.id)
    third = ask(alice, g.model, prompts[2], previous=second.id)
    assert cached(third) > 0 and g.metric(DISK_READS, outcome="hit") >= 1, third.usage
    assert g.metric("mlx_gateway_responses_stored", tenant="alice") == 3
    assert g.metric("mlx_gateway_responses_stored", tenant="bob") == 0
    assert g.metric("mlx_gateway_responses_torn_total") == 0
    alice.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(second.id)
    assert g.signal(signal.SIGTERM) == 0

    # store: false and the delete left nothing behind; bob stored nothing.
    assert stored_ids(data / "responses.sqlite3") == {"alice": {first.id, third.id}}


def test_a_chain_continues_on_another_replica_through_redis(serve):
    with RedisServer(require_redis()) as redis_server:
        flags = ("--responses-store", redis_server.url)
        a, b = serve(*flags, name="replica-a"), serve(*flags, name="replica-b")
        a.wait_ready()
        b.wait_ready()
        on_a, on_b, bob_b = a.sdk("alice"), b.sdk("alice"), b.sdk("bob")
        first = ask(on_a, a.model, text(4, 30))
        second = ask(on_b, b.model, text(5, 8), previous=first.id)
        assert chain_texts(on_a, second.id) == [("user", text(4, 30)), ("assistant", first.output_text),
                                                ("user", text(5, 8))]
        assert on_b.responses.retrieve(first.id).model_dump() == first.model_dump()
        assert_foreign(bob_b, b.model, first.id)
        unstored = ask(on_a, a.model, "not to be kept", store=False)
        with pytest.raises(openai.NotFoundError):
            on_b.responses.retrieve(unstored.id)

        assert a.signal(signal.SIGKILL) == -signal.SIGKILL  # a replica lost: the chain goes on
        third = ask(on_b, b.model, text(6, 8), previous=second.id)
        assert [t for _, t in chain_texts(on_b, third.id)][-2:] == [second.output_text, text(6, 8)]
        assert b.metric("mlx_gateway_responses_stored", tenant="alice") == 3

        import redis

        client = redis.Redis.from_url(redis_server.url)
        assert sorted(k.decode() for k in client.hkeys("mlxgw:{alice}:responses:body")) == sorted(
            [first.id, second.id, third.id])  # not the unstored one
        assert not client.keys("mlxgw:{bob}:responses:*")
        client.close()

        redis_server.stop()  # the store is gone: answers say so
        lost = ask(on_b, b.model, "while the store is down")
        assert lost.store is False
        with pytest.raises(openai.InternalServerError) as e:
            on_b.responses.retrieve(third.id)
        assert e.value.status_code == 503
        assert b.metric("mlx_gateway_responses_store_failures_total", operation="put") >= 1
