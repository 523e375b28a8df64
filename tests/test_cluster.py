"""Beyond one machine: two ``mlx-gateway serve`` replicas behind SGLang's router
(sglang-router), with the cluster front (``deploy/cluster/front.py``) in front, all real
subprocesses (``tests/cluster_stack.py``; docs/cluster.md).

- the router registers the replicas from their ``/server_info`` and ``/model_info``;
- requests sharing a prefix go to one replica and meet its prefix cache;
- one tenant's 429s reach it at once, and leave the replicas in service for the others;
- Anthropic Messages and OpenAI Responses work through the front, with their own
  parameters (the router 404s the first and re-writes the second);
- a replica killed under load: through the front no request started after the kill
  fails (failover) and a stream in flight ends with its error event; through the router
  alone, what it sends to the dead replica until its health checks fails (counted); every
  request ends within a bound, and the replica restarted on its port serves again;
- a replica registers itself with the router and takes itself out as it drains
  (``gateway/router_link.py``).
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from cluster_stack import CLI, Cluster, Replica, router_available, wait_for
from conftest import model_path
from gateway.router_link import RouterLink
from gateway.tenancy.tenants import hash_key

WHY_NOT = router_available()
if WHY_NOT:
    pytest.skip(WHY_NOT, allow_module_level=True)

KEY_A, KEY_B = "mgw-cluster-a-key", "mgw-cluster-b-key"
A_PER_MINUTE = 2
TENANTS = f"""
[tenants.a]
key_sha256 = ["{hash_key(KEY_A)}"]
requests_per_minute = {A_PER_MINUTE}

[tenants.b]
key_sha256 = ["{hash_key(KEY_B)}"]
"""
BOUND = 30.0  # seconds within which every request of the failover test must end
SYSTEM = "You are a careful assistant. " + " ".join(f"rule{i} applies" for i in range(60))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cluster")
    tenants = tmp / "tenants.toml"
    tenants.write_text(TENANTS)
    c = Cluster(tmp, model_path("qwen3"), 2, replica_args=["--tenants", str(tenants), "--max-tokens", "16"])
    with c:
        yield c


@pytest.fixture(scope="module")
def model(cluster) -> str:
    return cluster.replicas[0].model


def chat(client: httpx.Client, key: str, model: str, messages: list, **kw) -> httpx.Response:
    return client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"model": model, "messages": messages, "max_tokens": 8, "temperature": 0, **kw})


def cached(resp: httpx.Response) -> int:
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages"}


def served(replica: Replica, tenant: str = "b", endpoint=None) -> int:
    """Requests of ``tenant`` that ``replica`` answered with 200 (on ``endpoint``)."""
    labels = {"tenant": tenant, "status": "200"}
    if endpoint:
        labels["endpoint"] = PATHS[endpoint]
    return int(replica.metric("mlx_gateway_requests_total", **labels))


# ------------------------------------------------------------------ registration


def test_the_router_registers_each_replica_with_its_model(cluster, model):
    workers = cluster.router.workers()
    assert sorted(w["url"] for w in workers) == sorted(r.url for r in cluster.replicas)
    for w in workers:
        assert w["is_healthy"] and w["model_id"] == model
        assert w["metadata"]["model_type"] == "qwen3"
        assert w["metadata"]["model_path"] == str(Path(model).resolve())
    log = cluster.router.log_text()
    for complaint in ("returned 404", "falling back", "No tokenizer_path", "Failed to load tokenizer", "ERROR"):
        assert complaint not in log, log[-3000:]
    info = cluster.replicas[0].client.get("/server_info").json()
    assert info["served_model_name"] == model and info["max_running_requests"] > 0
    assert info["load"] == {"running": 0, "waiting": 0} or set(info["load"]) == {"running", "waiting"}
    assert cluster.replicas[0].client.get("/get_model_info").json()["model_type"] == "qwen3"


# ------------------------------------------------------------------ prefix affinity


def test_turns_sharing_a_prefix_go_to_one_replica_and_meet_its_cache(cluster, model):
    """Through the front, to the router (cache_aware): every second turn is served from the
    first one's prefix cache, which only the replica that served the first one holds."""
    before = [served(r, endpoint="chat") for r in cluster.replicas]
    with httpx.Client(base_url=cluster.front.url, timeout=60) as f:
        for conv in range(4):
            first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"conversation {conv}: hello"}]
            r1 = chat(f, KEY_B, model, first)
            assert r1.status_code == 200, r1.text
            second = first + [r1.json()["choices"][0]["message"], {"role": "user", "content": "and then?"}]
            r2 = chat(f, KEY_B, model, second)
            assert r2.status_code == 200, r2.text
            assert cached(r2) >= r1.json()["usage"]["prompt_tokens"] - 2, (r1.json()["usage"], r2.json()["usage"])
    after = [served(r, endpoint="chat") for r in cluster.replicas]
    assert sum(after) - sum(before) == 8


# ------------------------------------------------------------------ tenants' 429s


def test_one_tenants_429s_pass_through_and_leave_the_replicas_to_the_others(cluster, model):
    tried = sum(r.metric("mlx_gateway_requests_total", tenant="a") for r in cluster.replicas)
    statuses = []
    with httpx.Client(base_url=cluster.front.url, timeout=60) as f:
        for i in range(14):
            t0 = time.monotonic()
            r = chat(f, KEY_A, model, [{"role": "user", "content": "the same question again"}])
            statuses.append(r.status_code)
            if r.status_code == 429:
                assert time.monotonic() - t0 < 1.0  # not retried with back-off
                assert int(r.headers["retry-after"]) >= 1 and r.headers["x-ratelimit-limit-requests"] == "2"
                assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert statuses.count(429) >= 14 - 2 * A_PER_MINUTE, statuses
        # each request reached a replica once: the router sent no 429 again
        now = sum(r.metric("mlx_gateway_requests_total", tenant="a") for r in cluster.replicas)
        assert now - tried == 14
        # the other tenant is served, by both replicas as before
        for i in range(6):
            r = chat(f, KEY_B, model, [{"role": "user", "content": f"{random.random()} unrelated {i}"}])
            assert r.status_code == 200, r.text
    assert cluster.router.healthy() == {r.url for r in cluster.replicas}
    metrics = cluster.router.metrics()
    for line in metrics.splitlines():
        if line.startswith("smg_worker_cb_state{"):
            assert line.endswith(" 0"), line  # every circuit closed
        if line.startswith("smg_worker_retries_total{"):
            assert line.endswith(" 0"), line


# ------------------------------------------------------------------ Anthropic and Responses


def test_anthropic_and_responses_work_through_the_front_with_their_own_parameters(cluster, model):
    direct = cluster.replicas[0].url
    # Anthropic Messages (x-api-key, which the router would drop; a route the router 404s)
    a = anthropic.Anthropic(base_url=cluster.front.url, api_key=KEY_B, max_retries=0, timeout=60)
    ask = dict(model=model, max_tokens=12, extra_body={"temperature": 0}, system=SYSTEM,
               messages=[{"role": "user", "content": "anthropic conversation"}])
    m1 = a.messages.create(**ask)
    assert m1.stop_reason in ("end_turn", "max_tokens") and m1.usage.output_tokens > 0
    same = anthropic.Anthropic(base_url=direct, api_key=KEY_B, max_retries=0, timeout=60).messages.create(**ask)
    assert same.content[0].text == m1.content[0].text  # greedy: the request's temperature held
    turn2 = {**ask, "messages": ask["messages"] + [{"role": "assistant", "content": m1.content[0].text or "ok"},
                                                   {"role": "user", "content": "more"}]}
    with a.messages.stream(**turn2) as s:
        m2 = s.get_final_message()
    assert m2.usage.cache_read_input_tokens > 0  # the same replica, its prefix cache
    body = {"model": model, "max_tokens": 12, "messages": ask["messages"]}
    assert httpx.post(f"{cluster.router.url}/v1/messages", json=body, headers={"x-api-key": KEY_B}).status_code == 404

    # OpenAI Responses (the router would set temperature 1.0, top_p 1.0, priority 0...)
    o = openai.OpenAI(base_url=cluster.front.url + "/v1", api_key=KEY_B, max_retries=0, timeout=60)
    ask = dict(model=model, instructions=SYSTEM, input="responses conversation", max_output_tokens=12,
               temperature=0, top_p=0.5)
    r1 = o.responses.create(**ask)
    assert r1.status in ("completed", "incomplete") and r1.temperature == 0 and r1.top_p == 0.5
    direct_r = openai.OpenAI(base_url=direct + "/v1", api_key=KEY_B, max_retries=0).responses.create(**ask)
    assert direct_r.output_text == r1.output_text
    r2 = o.responses.create(model=model, previous_response_id=r1.id, input="go on", max_output_tokens=8,
                            temperature=0)
    assert r2.usage.input_tokens_details.cached_tokens > 0  # to the replica holding r1
    events = list(o.responses.create(model=model, previous_response_id=r2.id, input="streamed",
                                     max_output_tokens=8, stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")  # max_output_tokens
    assert o.responses.retrieve(r2.id).id == r2.id
    assert [m.id for m in o.models.list().data] == [model]


# ------------------------------------------------------------------ failover


class Load:
    """Threads sending requests to ``url`` (the front, or a router) until stopped; every
    outcome recorded as (start, end, kind, outcome, detail), outcome ``ok``, ``status`` (an
    error status), ``event`` (a stream that ended with its protocol's error event) or
    ``cut`` (a connection that broke, or a stream that ended without its end)."""

    KINDS = ("chat", "chat-stream", "chat-new", "chat-stream", "messages", "messages-stream")

    def __init__(self, url: str, model: str, kinds=KINDS):
        self.url, self.model = url, model
        self.results: list[tuple] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.run, args=(i, k), daemon=True) for i, k in enumerate(kinds)]

    def start(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(BOUND + 10)
        assert not any(t.is_alive() for t in self.threads), "a request hung"

    def one(self, c: httpx.Client, i: int, kind: str, n: int) -> tuple[str, str]:
        head = f"{random.random():.6f} " if kind == "chat-new" else ""
        text = f"{head}load {i} request {n} " + "word " * 40
        body = {"model": self.model, "max_tokens": 24, "messages": [{"role": "user", "content": text}],
                "stream": kind.endswith("stream")}
        if kind.startswith("messages"):
            path, done, error = "/v1/messages", "event: message_stop", "event: error"
        else:
            path, done, error = "/v1/chat/completions", "data: [DONE]", 'data: {"error"'
        with c.stream("POST", path, json=body, headers={"x-api-key": KEY_B, "Authorization": f"Bearer {KEY_B}"}) as r:
            data = r.read().decode()
        if r.status_code != 200:
            return "status", f"{r.status_code} {data[:160]}"
        if body["stream"]:
            if error in data:
                return "event", data[data.index(error):][:200]
            if done not in data:
                return "cut", f"stream ended without its end: {data[-160:]}"
        return "ok", ""

    def run(self, i: int, kind: str) -> None:
        with httpx.Client(base_url=self.url, timeout=BOUND) as c:
            n = 0
            while not self.stop.is_set():
                n += 1
                t0 = time.monotonic()
                try:
                    outcome, detail = self.one(c, i, kind, n)
                except httpx.HTTPError as e:
                    outcome, detail = "cut", repr(e)[:160]
                self.results.append((t0, time.monotonic(), kind, outcome, detail))

    def failed(self, since: float) -> list[tuple]:
        """The failed requests as (start, end) relative to ``since``, kind, outcome, detail."""
        return [(round(s - since, 2), round(e - since, 2), kind, o, d) for s, e, kind, o, d in self.results
                if o != "ok"]


# ------------------------------------------------------------------ registering


def test_a_replica_registers_itself_and_leaves_as_it_drains(cluster, model, tmp_path):
    """``RouterLink`` in-process (as ``serve --router-url`` runs it): a replica the router
    was not given is added once it serves, and removed as soon as it drains, so that no
    client meets its 503s; its running requests finish."""
    r3 = Replica(tmp_path, Path(model), "--tenants", str(cluster.tmp / "tenants.toml"), name="replica3").start()
    draining = threading.Event()
    link = None
    try:
        r3.wait_ready()
        link = RouterLink(cluster.router.url, r3.url, draining=draining.is_set, interval=1.0, poll=0.05).start()
        cluster.router.wait_healthy([r3.url], timeout=15)
        cluster.front.wait_workers(3, timeout=10)
        # it takes requests: the front spreads conversations over the replicas the router
        # holds as healthy (rendezvous hashing), so some go to the new one. (The router's own
        # cache_aware choice of a replica for a fresh chat prompt, once its trees hold other
        # replicas' prompts, does not reliably pick a replica registered later.)
        with httpx.Client(base_url=cluster.front.url, timeout=60) as f:
            def got_one() -> bool:
                r = f.post("/v1/messages", headers={"x-api-key": KEY_B}, json={
                    "model": model, "max_tokens": 4,
                    "messages": [{"role": "user", "content": f"conversation {random.getrandbits(40):x}"}]})
                assert r.status_code == 200, r.text
                return served(r3, endpoint="messages") > 0
            wait_for(got_one, 20, "the front to send a request to the registered replica", interval=0)
        draining.set()  # what SIGTERM does to front.draining
        r3.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: r3.url not in {w["url"] for w in cluster.router.workers()}, 5,
                 "the router to drop the draining replica")
        assert r3.proc.wait(60) == 0
    finally:
        if link is not None:
            link.stop()
        r3.close()


def test_serve_router_url_registers_and_deregisters(cluster, model, tmp_path):
    """``mlx-gateway serve --router-url URL``: the same, from the gateway's own flag."""
    help_text = subprocess.run([*CLI, "serve", "--help"], capture_output=True, text=True).stdout
    if "--router-url" not in help_text:
        pytest.skip("serve has no --router-url yet (gateway/config.py and gateway/server.py: see docs/cluster.md)")
    r4 = Replica(tmp_path, Path(model), "--router-url", cluster.router.url, name="replica4").start()
    try:
        r4.wait_ready()
        cluster.router.wait_healthy([r4.url], timeout=15)
        r4.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: r4.url not in {w["url"] for w in cluster.router.workers()}, 5,
                 "the router to drop the draining replica")
        assert r4.proc.wait(60) == 0
    finally:
        r4.close()


def test_the_link_runs_beside_a_gateway_too(cluster, model, tmp_path):
    """``python -m gateway.router_link --router URL --worker URL``: registers the gateway
    once it serves, deregisters it when it drains, registers it again when it serves."""
    r5 = Replica(tmp_path, Path(model), name="replica5").start()
    side = subprocess.Popen([sys.executable, "-m", "gateway.router_link", "--router", cluster.router.url,
                             "--worker", r5.url, "--poll", "0.1", "--interval", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        r5.wait_ready()
        cluster.router.wait_healthy([r5.url], timeout=15)
        r5.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: r5.url not in {w["url"] for w in cluster.router.workers()}, 5,
                 "the router to drop the draining replica")
        r5.proc.wait(60)
        r5.start()
        r5.wait_ready()
        cluster.router.wait_healthy([r5.url], timeout=15)
    finally:
        side.terminate()
        side.wait(10)
        r5.close()
        wait_for(lambda: r5.url not in cluster.router.healthy(), 10, "the router to drop the closed replica")


# ------------------------------------------------------------------ failover (last: it restarts a
# replica, after which the router's cache_aware tree no longer sends fresh prompts to a
# replica registered later)


def test_a_replica_killed_under_load(cluster, model):
    """SIGKILL one replica under load, through the front and through the router alone:

    - through the front, every request started after the kill succeeds (one whose replica
      failed before the first byte of its answer went to the other: the router's
      ``call_upstream_request_error`` sends it straight to a replica, a refused
      connection to the next); a stream cut after its first byte ends at once with its
      protocol's error event (no hang, no broken connection);
    - through the router alone (no retries, so that a 429 is not sent again), requests it
      sends to the dead replica until its health checks take it out (about 2 s) fail:
      counted and printed; every request ends within the bound;
    - restarted on its port, the replica serves again within 1-2 s of serving."""
    r1, r2 = cluster.replicas
    loads = {"front": Load(cluster.front.url, model),
             "router alone": Load(cluster.router.url, model, ("chat", "chat-stream", "chat-new"))}
    try:
        for load in loads.values():
            load.start()
        time.sleep(2)
        assert served(r2) > 0
        t_kill = time.monotonic()
        r2.kill()
        wait_for(lambda: r2.url not in cluster.router.healthy(), 10, "the router to take the dead replica out")
        t_out = time.monotonic()
        time.sleep(3)  # only the live replica now
        t_restart = time.monotonic()
        r2.start()
        r2.wait_ready()
        t_ready = time.monotonic()
        chat_before, messages_before = served(r2, endpoint="chat"), served(r2, endpoint="messages")
        wait_for(lambda: served(r2, endpoint="chat") > chat_before, 10, "the router to send to the replica again")
        t_chat = time.monotonic()
        wait_for(lambda: served(r2, endpoint="messages") > messages_before, 10, "the front to send to it again")
        t_messages = time.monotonic()
        time.sleep(1)
    finally:
        for load in loads.values():
            load.finish()
    lines = []
    for name, load in loads.items():
        assert max(end - start for start, end, *_ in load.results) < BOUND
        failed = load.failed(t_kill)
        assert all(f[1] - f[0] < 5 for f in failed), failed[:5]  # the errors came at once
        after = [f for f in failed if f[0] > 0]
        assert sum(1 for r in load.results if r[3] == "ok") > 30, name
        lines.append(f"{name}: {len(failed)} of {len(load.results)} failed, {len(after)} of them started after the "
                     f"kill (the last at +{max((f[0] for f in after), default=0):.2f} s)")
        if name == "front":
            assert not after, after[:5]
            assert all(f[3] == "event" for f in failed), failed[:5]  # streams in flight: their error event
        else:
            assert all(f[0] < t_out - t_kill + 1.0 for f in after), after[-5:]  # only until the health checks
    assert t_out - t_kill < 5
    print(f"\nkilled replica out of the router after {t_out - t_kill:.2f} s; " + "; ".join(lines) +
          f"; restarted (ready {t_ready - t_restart:.1f} s after start), served chat again {t_chat - t_ready:.2f} s "
          f"and messages {t_messages - t_ready:.2f} s after ready")
