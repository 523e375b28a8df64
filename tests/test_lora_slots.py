"""Waiting for a LoRA adapter slot over HTTP: with every slot of ``--max-loras`` held by a
running request, a request for another adapter waits (in arrival order) until one frees,
then loads its adapter and runs; requests for the base model pass it; a waiter whose
client leaves is gone from the queue and holds nothing."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import mlx_lm

from conftest import live_server, model_path, sample, wait_until
from scheduler.lora import adapters_of
from test_lora import reference_tokens, write_mlx_lm
from test_lora_api import pieces, want_pieces

LONG = 1600  # tokens of the request holding the only slot (ignore_eos: it runs to the end)


def body(model: str, prompt: list[int], n: int, **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 1, **extra}


async def holding_the_slot(ac: httpx.AsyncClient, model: str, prompt: list[int]) -> asyncio.Task:
    """A task streaming a ``LONG`` greedy answer under ``model`` (its result: the time its
    stream ended, seconds, monotonic), once its first token came."""
    started = asyncio.Event()
    task = asyncio.create_task(hold_the_slot(ac, model, prompt, started))
    await asyncio.wait([asyncio.ensure_future(started.wait()), task], timeout=120,
                       return_when=asyncio.FIRST_COMPLETED)
    assert started.is_set(), task.result() if task.done() else "no first token"
    return task


async def hold_the_slot(ac: httpx.AsyncClient, model: str, prompt: list[int], started: asyncio.Event) -> float:
    async with ac.stream("POST", "/v1/completions", json=body(model, prompt, LONG, stream=True,
                                                                ignore_eos=True)) as r:
        assert r.status_code == 200, await r.aread()
        n = 0
        async for line in r.aiter_lines():
            choices = json.loads(line[6:])["choices"] if line.startswith("data: {") else None
            if choices and choices[0]["logprobs"]:
                n += len(choices[0]["logprobs"]["tokens"])
                started.set()
    assert n == LONG, n
    return time.monotonic()


async def until(predicate, timeout: float, what: str) -> None:
    """Poll ``predicate`` (this test's own loop) until true; AssertionError after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def adapters(tmp_path, names: list[str]):
    base = model_path("qwen3")
    model, tok = mlx_lm.load(str(base))
    paths = {n: write_mlx_lm(tmp_path / n, model, i + 1) for i, n in enumerate(names)}
    return base, tok, paths


def test_a_request_for_another_adapter_waits_for_the_slot_then_runs_as_alone(tmp_path):
    base, tok, paths = adapters(tmp_path, ["alpha", "beta", "gamma"])
    rng = random.Random(3)
    pa, pb, p0 = ([rng.randrange(10, 900) for _ in range(10)] for _ in range(3))
    with live_server(base, lora_modules=[f"{n}={p}" for n, p in paths.items()], max_loras=1,
                     max_waiting=1) as srv:
        busy = lambda: sample(srv.registry, "mlx_gateway_lora_loads_total", model="test-model", result="busy")

        async def scenario():
            async with httpx.AsyncClient(base_url=srv.url, timeout=300) as ac:
                a = await holding_the_slot(ac, "alpha", pa)
                b = asyncio.create_task(ac.post("/v1/completions", json=body("beta", pb, 6)))
                await until(lambda: busy() >= 1 or b.done(), 60, "beta to find the only slot held")
                plain = await ac.post("/v1/completions", json=body("test-model", p0, 4))
                over = await ac.post("/v1/completions", json=body("gamma", p0, 4))  # past --max-waiting 1
                passed = not a.done() and not b.done()  # the base's request ran while beta waited
                a_end = await a
                rb = await b
                return plain, over, passed, a_end, rb, time.monotonic()

        plain, over, passed, a_end, rb, b_end = asyncio.run(scenario())
        assert rb.status_code == 200, rb.text
        assert over.status_code == 503 and over.json()["error"]["code"] == "overloaded", over.text
        assert over.headers["retry-after"] == "1"
        assert pieces(rb.json()) == want_pieces(tok, reference_tokens(base, paths["beta"], pb, 6))
        assert plain.status_code == 200, plain.text
        assert pieces(plain.json()) == want_pieces(tok, reference_tokens(base, None, p0, 4))
        assert passed, "the base model's request waited behind the adapter's"
        assert b_end > a_end
        assert busy() == 1
        assert sample(srv.registry, "mlx_gateway_lora_loads_total", model="test-model", result="loaded") == 2
        assert adapters_of(srv.engine.model).resident_names() == ["beta"]


def test_waiters_go_in_arrival_order_and_one_whose_client_left_holds_nothing(tmp_path):
    from gateway.models.lora import waiters_of

    base, tok, paths = adapters(tmp_path, ["alpha", "beta", "gamma"])
    rng = random.Random(4)
    pa, pb, pc = ([rng.randrange(10, 900) for _ in range(10)] for _ in range(3))
    with live_server(base, lora_modules=[f"{n}={p}" for n, p in paths.items()], max_loras=1) as srv:

        async def scenario():
            async with httpx.AsyncClient(base_url=srv.url, timeout=300) as ac:
                a = await holding_the_slot(ac, "alpha", pa)
                queue = waiters_of(adapters_of(srv.engine.model)).queue
                leaving = httpx.AsyncClient(base_url=srv.url, timeout=300)
                b = asyncio.create_task(leaving.post("/v1/completions", json=body("beta", pb, 6)))
                await until(lambda: len(queue) == 1, 60, "beta to wait")
                done = []
                c = asyncio.create_task(ac.post("/v1/completions", json=body("gamma", pc, 6)))
                c.add_done_callback(lambda _: done.append("gamma"))
                await until(lambda: len(queue) == 2, 60, "gamma to wait behind beta")
                b2 = asyncio.create_task(ac.post("/v1/completions", json=body("beta", pb, 6)))
                b2.add_done_callback(lambda _: done.append("beta"))
                await until(lambda: len(queue) == 3, 60, "beta again to wait behind gamma")
                b.cancel()
                await asyncio.gather(b, return_exceptions=True)
                await leaving.aclose()  # the first beta's client leaves
                await until(lambda: len(queue) == 2, 60, "the waiter whose client left to go")
                left_first = not a.done()  # it went when its client left, not when alpha ended
                await a
                return left_first, await c, await b2, done

        left_first, rc, rb, done = asyncio.run(scenario())
        assert left_first
        assert rc.status_code == 200, rc.text
        assert rb.status_code == 200, rb.text
        assert done == ["gamma", "beta"]  # (max_loras 1: beta loads only once gamma's request ended)
        assert pieces(rc.json()) == want_pieces(tok, reference_tokens(base, paths["gamma"], pc, 6))
        assert pieces(rb.json()) == want_pieces(tok, reference_tokens(base, paths["beta"], pb, 6))
        wait_until(lambda: sample(srv.registry, "mlx_gateway_requests_total", tenant="default", model="beta",
                                  endpoint="/v1/completions", status="499") == 1, 30, "the leaver counted")
        found = adapters_of(srv.engine.model)
        wait_until(found.slot_free, 30, "every lease and request let go of its adapter")
        assert not waiters_of(found).queue


def test_a_tenants_max_queued_bounds_its_own_waiters_only(tmp_path):
    from gateway.models.lora import waiters_of
    from gateway.tenancy.tenants import hash_key

    base, tok, paths = adapters(tmp_path, ["alpha", "beta", "gamma"])
    keys = {"one": "mgw-test-one-key", "two": "mgw-test-two-key"}
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants.one]\nkey_sha256 = ["{hash_key(keys["one"])}"]\nmax_queued = 1\n\n'
                       f'[tenants.two]\nkey_sha256 = ["{hash_key(keys["two"])}"]\n')
    prompt = [31, 32, 33, 34, 35, 36]
    with live_server(base, lora_modules=[f"{n}={p}" for n, p in paths.items()], max_loras=1,
                     tenants=str(tenants)) as srv:

        async def scenario():
            def as_(who):
                return {"Authorization": f"Bearer {keys[who]}"}

            async with httpx.AsyncClient(base_url=srv.url, timeout=300, headers=as_("two")) as ac:
                a = await holding_the_slot(ac, "alpha", prompt)
                queue = waiters_of(adapters_of(srv.engine.model)).queue
                b = asyncio.create_task(ac.post("/v1/completions", json=body("beta", prompt, 6), headers=as_("one")))
                await until(lambda: len(queue) == 1, 60, "tenant one's beta to wait")
                over = await ac.post("/v1/completions", json=body("gamma", prompt, 6), headers=as_("one"))
                c = asyncio.create_task(ac.post("/v1/completions", json=body("gamma", prompt, 6)))
                await until(lambda: len(queue) == 2, 60, "tenant two's gamma to wait")
                await a
                return over, await b, await c

        over, rb, rc = asyncio.run(scenario())
        assert over.status_code == 429 and over.json()["error"]["code"] == "queue_full", over.text
        for r, name in ((rb, "beta"), (rc, "gamma")):
            assert r.status_code == 200, r.text
            assert pieces(r.json()) == want_pieces(tok, reference_tokens(base, paths[name], prompt, 6))


def test_waiters_for_an_adapter_a_waiter_before_them_loaded_run_beside_it(tmp_path):
    """Two requests wait for beta's slot; the first loads beta when alpha's request ends,
    and the second runs beside it at once (beta is resident), not after its end."""
    from gateway.models.lora import waiters_of

    base, tok, paths = adapters(tmp_path, ["alpha", "beta"])
    rng = random.Random(5)
    pa, pb, pc = ([rng.randrange(10, 900) for _ in range(10)] for _ in range(3))
    with live_server(base, lora_modules=[f"{n}={p}" for n, p in paths.items()], max_loras=1) as srv:

        async def scenario():
            async with httpx.AsyncClient(base_url=srv.url, timeout=300) as ac:
                a = await holding_the_slot(ac, "alpha", pa)
                queue = waiters_of(adapters_of(srv.engine.model)).queue
                first = asyncio.create_task(ac.post("/v1/completions", json=body("beta", pb, 400, ignore_eos=True)))
                await until(lambda: len(queue) == 1, 60, "beta to wait")
                second = asyncio.create_task(ac.post("/v1/completions", json=body("beta", pc, 6)))
                await until(lambda: len(queue) == 2, 60, "beta again to wait behind it")
                await a
                rs = await second
                beside = not first.done()
                return beside, await first, rs

        beside, rf, rs = asyncio.run(scenario())
        assert rf.status_code == 200 and rs.status_code == 200, (rf.text, rs.text)
        assert beside, "the second request for beta waited for the first one's end"
        assert pieces(rs.json()) == want_pieces(tok, reference_tokens(base, paths["beta"], pc, 6))


def test_a_load_that_timed_out_holds_no_slot_when_it_runs_later(tmp_path, monkeypatch):
    """A request's load whose engine call timed out (503) may still run on the engine
    later; the lease it takes there is let go, so the only slot serves the next adapter
    rather than being held for ever.

    The engine stops answering just after the load has read its memory room (which asks
    the engine for its KV bytes) and answers again as soon as the load's own engine call
    has given up (in its ``finally``: ``resident_changed``), so the install runs late,
    after the 503 is decided, without a fixed wait in between."""
    import threading

    import gateway.models.lora as lora_mod

    base, tok, paths = adapters(tmp_path, ["alpha", "beta"])
    prompt = [41, 42, 43, 44, 45, 46]
    with live_server(base, lora_modules=[f"{n}={p}" for n, p in paths.items()], max_loras=1) as srv:
        models, room, changed = srv.front.models, srv.front.models.adapter_room, lora_mod.resident_changed
        blocking, release, blocked = threading.Event(), threading.Event(), []

        def room_then_block(slot):  # from here the engine answers nothing until release
            n = room(slot)
            blocked.append(srv.engine.seat.post_call(lambda: (blocking.set(), release.wait(60)), 90))
            assert blocking.wait(30), "the engine did not take the blocking call"
            return n

        def gave_up(front, handle):  # the load's engine call has ended: timed out, the engine being blocked
            release.set()
            changed(front, handle)

        monkeypatch.setattr(lora_mod, "LOAD_TIMEOUT", 0.5)
        monkeypatch.setattr(models, "adapter_room", room_then_block)
        monkeypatch.setattr(lora_mod, "resident_changed", gave_up)
        try:
            r = httpx.post(f"{srv.url}/v1/completions", json=body("beta", prompt, 4), timeout=60)
        finally:
            release.set()
        monkeypatch.undo()  # the real room and gauges again, and LOAD_TIMEOUT's 300 s
        assert len(blocked) == 1, blocked
        blocked[0].result(60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable", r.text
        found = adapters_of(srv.engine.model)
        wait_until(lambda: "beta" in found.resident_names(), 30, "the late load to run")
        assert found.slot_free(), "the late load's lease holds the only slot"
        ra = httpx.post(f"{srv.url}/v1/completions", json=body("alpha", prompt, 4), timeout=60)
        assert ra.status_code == 200, ra.text
        assert pieces(ra.json()) == want_pieces(tok, reference_tokens(base, paths["alpha"], prompt, 4))
