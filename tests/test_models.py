"""Several models in one gateway, over real HTTP: exact outputs beside each other, loading
on demand, LRU unloading under the memory budget, keep_alive, pins, allow-lists, the
admin API, the metrics, and a load that does not stall the other model's decoding.

The models are tiny random-weight ones of real architectures (qwen3 with the project's
own tokenizer, llama with the Llama 3 tokenizer) loaded through ``mlx_lm.load``.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx
import pytest

from conftest import (EventSink, assert_same_tokens, free_port, live_server, model_path, sample as metric,
                      serving, start_gateway, wait_until)
from gateway.config import ServeConfig
from gateway.backend import backend
from gateway.cpu import attention
from gateway.models import load_memo
from gateway.models.demo_model import build_model_dir
from gateway.models.spec import ModelSpec
from gateway.tenancy.tenants import hash_key
from scheduler import EngineRequest, SamplingParams
from scheduler.request import TokenEvent

PROMPTS = ["The sea and the mountains", "A story about a fox who", "Numbers one two three",
           "Write about the quiet town"]


def second_qwen3():
    """A second tiny qwen3 (other weights, the same shapes and tokenizer)."""
    base = model_path("qwen3")
    return build_model_dir(base.parent / f"{base.name}-seed1", "qwen3", tokenizer_dir=base, seed=1)


def weights_of(path) -> int:
    """Bytes the model's weights take once served (read from the shapes, lazily)."""
    import mlx_lm

    from gateway.cpu.weights import served_bytes

    model, _ = mlx_lm.load(str(path), lazy=True)
    return served_bytes(model)


def budget_for_one(path) -> int:
    """A memory budget (bytes) for the weights of the model at ``path`` and one short request
    on it, with speculation off, as the engine reserves it (``MemoryGate.held``), and a tenth
    more: less than two such models' weights (checked), so a second model needs the first
    unloaded."""
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    from scheduler.admission.memory import gate_for

    model, _ = mlx_lm.load(str(path), lazy=True)
    gate, n = gate_for(model, make_prompt_cache(model), 2048), 40  # tokens: more than PROMPTS' with the template
    weights = weights_of(path)
    held = gate.held([(n, 8, gate.prefill_need(n))])  # the batch's layer copy on one merge stream
    held += gate.shape.layer_bytes(gate.context(n + 8))  # and on a second (the engine thread's measured choice)
    budget = weights + int(1.1 * held)
    assert budget < 2 * weights, (budget, weights)
    return budget


def spec(name: str, path, **kw) -> ModelSpec:
    return ModelSpec(name=name, path=str(path), **kw)


def config(**kw) -> ServeConfig:
    return ServeConfig(port=free_port(), gather_wait=0.0, precompute_next_turn=False, **kw)


def completion(c: httpx.Client, model: str, prompt: str, n: int = 8) -> list[tuple[str, float]]:
    r = c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
                                        "logprobs": 0})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return list(zip(lp["tokens"], lp["token_logprobs"]))


async def acompletion(c: httpx.AsyncClient, model: str, prompt: str, n: int = 8) -> list[tuple[str, float]]:
    r = await c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": n,
                                              "temperature": 0, "logprobs": 0})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return list(zip(lp["tokens"], lp["token_logprobs"]))


# ---------------------------------------------------------------------- two models, exact


def test_two_architectures_interleaved_give_each_models_own_tokens():
    qwen, llama = model_path("qwen3"), model_path("llama")
    alone = {}
    for name, path in (("qwen", qwen), ("llama", llama)):
        with live_server(path) as s, s.client() as c:
            alone[name] = [completion(c, "test-model", p) for p in PROMPTS]
    specs = [spec("qwen", qwen, preload=True), spec("llama", llama, preload=True, aliases=("small",))]
    cfg = config()
    with serving(start_gateway(cfg, specs), cfg.port) as s:

        async def both():
            async with httpx.AsyncClient(base_url=s.url, timeout=120) as c:
                jobs = [acompletion(c, name, p) for p in PROMPTS for name in ("qwen", "small")]
                return await asyncio.gather(*jobs)

        got = asyncio.run(both())
        for i, p in enumerate(PROMPTS):
            assert_same_tokens(got[2 * i], alone["qwen"][i], f"qwen beside llama: {p}")
            assert_same_tokens(got[2 * i + 1], alone["llama"][i], f"llama beside qwen: {p}")
        with s.client() as c:
            listed = c.get("/v1/models").json()["data"]
            metrics = c.get("/metrics").text
        assert [(m["id"], m["loaded"], m.get("alias_of")) for m in listed] == [
            ("qwen", True, None), ("llama", True, None), ("small", True, "llama")]
        # One engine loop, each model's own series under its label.
        for name in ("qwen", "llama"):
            assert metric(s.registry, "mlx_gateway_decode_tokens_total", model=name) == 8 * len(PROMPTS)
            assert metric(s.registry, "mlx_gateway_prompt_tokens_total", model=name, api="completions") > 0
            assert metric(s.registry, "mlx_gateway_model_loaded", model=name) == 1
            assert metric(s.registry, "mlx_gateway_model_load_seconds_count", model=name) == 1
            assert f'mlx_gateway_prefix_cache_queries_total{{cache_group="default",model="{name}"}}' in metrics
        assert s.handle("qwen").engine.loop is s.handle("llama").engine.loop


# ---------------------------------------------------------------------- loading and unloading


def test_lru_unload_and_reload_under_a_budget_that_fits_one_model():
    a, b = model_path("qwen3"), second_qwen3()
    budget = budget_for_one(a)
    cfg = config(memory_budget=budget)
    specs = [spec("a", a, speculative="off"), spec("b", b, speculative="off")]
    with serving(start_gateway(cfg, specs), cfg.port) as s, s.client() as c:
        assert [sl.state for sl in s.gateway.models.slots] == ["unloaded", "unloaded"]
        first_a = completion(c, "a", PROMPTS[0])
        first_b = completion(c, "b", PROMPTS[0])  # a is idle and least recently used: unloaded
        states = {m["id"]: m["state"] for m in c.get("/admin/models").json()["data"]}
        assert states == {"a": "unloaded", "b": "loaded"}
        assert metric(s.registry, "mlx_gateway_model_unloads_total", model="a", reason="lru") == 1
        assert_same_tokens(completion(c, "a", PROMPTS[0]), first_a, "a after its reload")
        assert metric(s.registry, "mlx_gateway_model_unloads_total", model="b", reason="lru") == 1
        assert metric(s.registry, "mlx_gateway_model_load_seconds_count", model="a") == 2
        assert first_a != first_b  # two models indeed
        report = c.get("/admin/models").json()
        assert report["memory_budget_bytes"] == budget
        assert [m["weights_bytes"] > 0 for m in report["data"]] == [True, False]


def test_nothing_to_free_is_a_503_naming_the_budget_and_a_pinned_model_stays():
    a, b = model_path("qwen3"), second_qwen3()
    cfg = config(memory_budget=budget_for_one(a))
    specs = [spec("a", a, pin=True, preload=True, speculative="off"), spec("b", b, speculative="off")]
    with serving(start_gateway(cfg, specs), cfg.port) as s, s.client() as c:
        r = c.post("/v1/chat/completions", json={"model": "b", "max_tokens": 4,
                                                 "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "5"
        err = r.json()["error"]
        assert err["code"] == "insufficient_memory" and "--memory-budget" in err["message"]
        assert "'a'" in err["message"] and "pinned" in err["message"]
        r = c.post("/v1/messages", json={"model": "b", "max_tokens": 4,
                                         "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error", r.text
        assert s.gateway.models.find("a").state == "loaded"
        r = c.post("/admin/models/a/unload")
        assert r.status_code == 409 and "pinned" in r.json()["error"]["message"], r.text
        # The pinned model still serves.
        assert len(completion(c, "a", PROMPTS[1], 4)) == 4


def test_keep_alive_expiry_unloads_an_idle_model_and_a_request_brings_it_back():
    cfg = config()
    specs = [spec("m", model_path("qwen3"), keep_alive=0.5)]
    with serving(start_gateway(cfg, specs), cfg.port) as s, s.client() as c:
        first = completion(c, "m", PROMPTS[2])
        slot = s.gateway.models.find("m")
        wait_until(lambda: slot.state == "unloaded", 30, "keep_alive to unload the model")
        assert metric(s.registry, "mlx_gateway_model_unloads_total", model="m", reason="keep_alive") == 1
        assert metric(s.registry, "mlx_gateway_model_loaded", model="m") == 0
        assert_same_tokens(completion(c, "m", PROMPTS[2]), first, "after keep_alive expiry")


def test_concurrent_first_requests_load_once_and_a_waiting_stream_gets_loading_comments():
    cfg = config()
    with serving(start_gateway(cfg, [spec("m", model_path("llama"))]), cfg.port) as s:

        async def burst():
            async with httpx.AsyncClient(base_url=s.url, timeout=120) as c:
                body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                        "stream": True}

                async def stream() -> list[str]:
                    async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                        assert r.status_code == 200
                        return [line async for line in r.aiter_lines() if line]

                return await asyncio.gather(stream(), *(acompletion(c, "m", p, 4) for p in PROMPTS))

        lines, *answers = asyncio.run(burst())
        assert metric(s.registry, "mlx_gateway_model_load_seconds_count", model="m") == 1
        assert all(len(a) == 4 for a in answers)
        assert lines[-1] == "data: [DONE]"
        comments = [x for x in lines if x.startswith(": loading model m")]
        load = metric(s.registry, "mlx_gateway_model_load_seconds_sum", model="m")
        assert len(comments) >= int(load) - 1, (load, lines[:5])


def medium_qwen3():
    """A qwen3 large enough that a decode step takes about 10 ms on a 2-core CPU (a tiny
    model's 1 ms step is below Python's 5 ms thread switch interval)."""
    base = model_path("qwen3")
    return build_model_dir(base.parent / f"{base.name}-512x8", "qwen3", tokenizer_dir=base, overrides={
        "hidden_size": 512, "num_hidden_layers": 8, "intermediate_size": 1536, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 64})


# What a user sees of a stall: the longest wait between two tokens of a decoding stream,
# held to the gap bound the engine keeps beside a long prefill (bench_serve's stall
# scenario, docs/scheduling.md). The loader thread's CPU work (weights, tokenizer, grammar
# index, the timed forwards and kernels choosing the new model's CPU paths and chunk floor)
# shares the cores with A's steps, so A's steps slow while B loads: on 2 cores the largest
# gap measured 35-100 ms against a 14-20 ms step, and 110-120 ms against a 23-25 ms step in
# a slow hour (a bound of twice the step failed there). A load that held the engine loop
# would stop A for the whole load: every load here, a first load's kernel measurements
# included, takes longer than this bound, and A must also keep stepping through it.
GAP_MAX = 0.35  # seconds
# A kept 0.32-0.37 of its usual step rate through a first load here (the load's kernel
# measurements take both cores); a load that held the engine leaves it none
RATE_KEPT = 0.1  # of A's usual step rate, at least, while B loads


def test_a_load_does_not_stall_the_other_models_decoding():
    """While model A decodes, model B is loaded: A's largest gap between tokens, as the
    engine emits them, stays under :data:`GAP_MAX`, and A takes at least :data:`RATE_KEPT`
    of its usual steps (the median of its gaps without a load) during the load, in the best
    of three tries; a passing try's load lasts longer than :data:`GAP_MAX`, so a load that
    held A's engine would fail both. Measured at the engine: over HTTP this process is also
    the client, and its own event loops share the GIL with the load."""
    cfg = config()
    # plain decode steps: a token each (a random model's greedy loops are drafted, and a
    # verify step's tokens arrive together: the median gap is then 0, the largest a step of 9)
    a_spec = spec("a", medium_qwen3(), preload=True, speculative="off")
    with serving(start_gateway(cfg, [a_spec, spec("b", second_qwen3())]), cfg.port) as s:
        a, b = s.handle("a"), s.gateway.models.find("b")
        no_eos = tuple((t, -100.0) for t in a.tokenizer.eos_token_ids)

        def decode(n: int, load: bool = False) -> tuple[list[float], tuple[float, float]]:
            """A's token times over ``n`` tokens, and when B's load began and ended."""
            times, sink, span = [], EventSink(), (0.0, 0.0)

            def timed(events):
                times.extend(time.monotonic() for e in events if isinstance(e, TokenEvent))
                sink(events)

            a.engine.submit(EngineRequest(f"r{n}{load}{len(tries)}", a.tokenizer.encode("the sea"),
                                          SamplingParams(max_tokens=n, logit_bias=no_eos), timed))
            if load:
                wait_until(lambda: len(times) >= 5, 30, "the first tokens")
                began = time.monotonic()
                s.gateway.models.load(b).result(60)
                span = (began, time.monotonic())
                assert len(times) < n, "the load must end while A decodes"
            assert sink.done.wait(60)
            return times, span

        tries: list[dict] = []
        a_shapes = attention.attention_shapes(a.engine.model)
        decode(20)  # warm
        for attempt in range(3):  # this machine's own noise can make one gap long: the best of three
            load_memo.forget()  # a first load: tokenizer, grammar index and probes (an earlier test may have loaded B)
            if attempt:  # and the kernel measurements too
                shapes = attention.attention_shapes(s.handle("b").engine.model) - a_shapes
                s.gateway.models.unload(b)
                if backend().kind == "cpu":  # the kernels measured again too
                    backend().attention.forget(shapes)
            usual, _ = decode(100)
            times, (began, ended) = decode(400, load=True)
            assert b.state == "loaded"
            step = statistics.median(y - x for x, y in zip(usual[2:], usual[3:]))
            during = [t for t in times if began <= t <= ended]
            gap = max(y - x for x, y in zip([began] + during, during + [ended]))
            kept = len(during) * step / (ended - began)
            tries.append({"load s": round(ended - began, 3), "gap max s": round(gap, 3), "step s": round(step, 4),
                          "rate kept": round(kept, 2)})
            # a load shorter than the bound cannot tell a stall from a step (a first try can
            # find B's kernels planned by an earlier test): the next try measures them again
            if ended - began > GAP_MAX and gap < GAP_MAX and kept >= RATE_KEPT:
                break
        else:
            raise AssertionError(f"A's decoding while B loads, in each try: {tries}")


# ---------------------------------------------------------------------- who may see which model


@pytest.fixture
def tenants_toml(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(f"""
[admin]
key_sha256 = ["{hash_key('mgw-admin')}"]

[tenants.ext]
key_sha256 = ["{hash_key('mgw-ext')}"]
models = ["small*"]

[tenants.agent]
key_sha256 = ["{hash_key('mgw-agent')}"]
""")
    return str(path)


def test_models_outside_a_tenants_list_answer_like_unknown_ones(tenants_toml):
    cfg = config(tenants=tenants_toml)
    specs = [spec("coder", model_path("qwen3"), preload=True),
             spec("chat", model_path("qwen3"), preload=True, aliases=("small-chat",))]
    from gateway.tenancy.tenants import load_tenants

    with serving(start_gateway(cfg, specs, load_tenants(tenants_toml)), cfg.port) as s, s.client() as c:
        ext, agent = {"Authorization": "Bearer mgw-ext"}, {"Authorization": "Bearer mgw-agent"}
        assert [m["id"] for m in c.get("/v1/models", headers=ext).json()["data"]] == ["small-chat"]
        assert len(c.get("/v1/models", headers=agent).json()["data"]) == 3
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        msgs = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        resp = {"input": "hi", "max_output_tokens": 2}
        for name in ("coder", "chat", "nowhere"):  # not allowed, and unknown: the same answer
            r = c.post("/v1/chat/completions", json={**chat, "model": name}, headers=ext)
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
            assert r.json()["error"]["message"] == f"the model '{name}' does not exist"
            r = c.post("/v1/messages", json={**msgs, "model": name}, headers=ext)
            assert r.status_code == 404 and r.json()["type"] == "error", r.text
            assert r.json()["error"]["type"] == "not_found_error"
            r = c.post("/v1/responses", json={**resp, "model": name}, headers=ext)
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
            assert c.get(f"/v1/models/{name}", headers=ext).status_code == 404
        assert c.post("/v1/chat/completions", json={**chat, "model": "small-chat"}, headers=ext).status_code == 200
        assert c.post("/v1/chat/completions", json={**chat, "model": "coder"}, headers=agent).status_code == 200
        # No model named: the first one the key may use.
        r = c.post("/v1/chat/completions", json=chat, headers=ext)
        assert r.status_code == 200 and r.json()["model"] == "chat", r.text
        # The admin API is for admin keys.
        assert c.get("/admin/models", headers=agent).status_code == 403
        assert c.get("/admin/models", headers={"Authorization": "Bearer mgw-admin"}).status_code == 200


def test_the_default_model_is_served_as_before():
    """One ``--model``: served under its name and any ``--served-model-name``, pinned and
    loaded at start; a request without ``model`` goes to it."""
    with live_server(model_path("qwen3"), served_model_names=["alias"]) as s, s.client() as c:
        slot = s.gateway.models.slots[0]
        assert slot.spec.pin and slot.state == "loaded"
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["test-model", "alias"]
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "test-model"
        assert c.get("/health").json()["models"] == {"test-model": "loaded"}


def test_an_unloaded_models_prefix_cache_goes_to_its_disk_tier_and_comes_back(tmp_path):
    cfg = config(prompt_cache_dir=str(tmp_path / "pcache"))
    prompt = " ".join(f"word{i % 13} line{i % 7}" for i in range(60))
    body = {"model": "m", "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 0}
    with serving(start_gateway(cfg, [spec("m", model_path("qwen3"))]), cfg.port) as s, s.client() as c:
        first = c.post("/v1/completions", json=body).json()
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        r = c.post("/admin/models/m/unload")
        assert r.status_code == 200 and r.json()["state"] == "unloaded", r.text
        assert list((tmp_path / "pcache").rglob("*.safetensors")), "the unload should write the cache to disk"
        again = c.post("/v1/completions", json=body).json()  # loads the model again
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 1
        assert metric(s.registry, "mlx_gateway_prompt_cache_disk_reads_total", model="m", outcome="hit") == 1
        assert again["choices"][0]["logprobs"]["tokens"] == first["choices"][0]["logprobs"]["tokens"]
        assert metric(s.registry, "mlx_gateway_model_unloads_total", model="m", reason="admin") == 1


def test_the_same_files_under_two_names_each_get_a_disk_tier(tmp_path):
    """Two served names of one model directory (e.g. a thinking and a non-thinking
    configuration) share the cache directory but not a disk tier: both load, and each
    finds only its own entries."""
    cfg = config(prompt_cache_dir=str(tmp_path / "pcache"))
    specs = [spec("a", model_path("qwen3")), spec("b", model_path("qwen3"))]
    prompt = " ".join(f"word{i % 11} line{i % 5}" for i in range(60))
    with serving(start_gateway(cfg, specs), cfg.port) as s, s.client() as c:
        got = {m: completion(c, m, prompt) for m in ("a", "b")}
        assert got["a"] == got["b"]  # the same weights
        assert c.get("/health").json()["models"] == {"a": "loaded", "b": "loaded"}
    dirs = {p.parent for p in (tmp_path / "pcache").rglob("*.safetensors")}
    assert len(dirs) == 2, dirs
