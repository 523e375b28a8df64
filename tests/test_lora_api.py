"""LoRA adapters over HTTP, vLLM's interface: ``--lora-modules``, ``model: NAME`` in the
APIs, ``/v1/models`` with ``parent``, ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
import mlx_lm

from conftest import live_server, model_path, sample, wait_until
from gateway.protocols.openai_format import LogprobFormatter
from test_lora import reference_tokens, write_mlx_lm, write_peft


def completion(c, model: str, prompt: list[int], n: int = 6) -> dict:
    r = c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
                                        "logprobs": 1})
    assert r.status_code == 200, r.text
    return r.json()


def pieces(body: dict) -> list[str]:
    """The completion's tokens as text pieces (its logprobs' ``tokens``)."""
    return body["choices"][0]["logprobs"]["tokens"]


def want_pieces(tok, tokens: list[int]) -> list[str]:
    """``tokens`` as the completions API writes them in its logprobs."""
    shown = LogprobFormatter(tok)
    return [shown._text(t) for t in tokens]


def test_lora_modules_serve_models_and_load_unload(tmp_path):
    base = model_path("qwen3")
    model, tok = mlx_lm.load(str(base))
    a = write_mlx_lm(tmp_path / "a", model, 1)
    p, p_ref = write_peft(tmp_path / "p", model, 4)
    rng = random.Random(2)
    prompts = [[rng.randrange(10, 900) for _ in range(12)] for _ in range(6)]
    with live_server(base, lora_modules=[f"alpha={a}"], max_loras=2) as srv:
        with srv.client() as c:
            models = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
            assert models["alpha"]["parent"] == "test-model" and models["alpha"]["root"] == str(a)
            assert c.get("/v1/models/alpha").json()["parent"] == "test-model"

            got = completion(c, "alpha", prompts[0])
            assert got["model"] == "alpha"
            want = reference_tokens(base, a, prompts[0], 6)
            assert pieces(got) == want_pieces(tok, want)

            r = c.post("/v1/load_lora_adapter", json={"lora_name": "peft", "lora_path": str(p)})
            assert r.status_code == 200, r.text
            assert "peft" in {m["id"] for m in c.get("/v1/models").json()["data"]}

            async def mixed():  # eight concurrent requests: the base and two adapters
                async with httpx.AsyncClient(base_url=srv.url, timeout=120) as ac:
                    names = ["test-model", "alpha", "peft", "alpha", "test-model", "peft", "alpha", "peft"]
                    bodies = [{"model": m, "prompt": prompts[i % len(prompts)], "max_tokens": 6, "temperature": 0,
                               "logprobs": 1} for i, m in enumerate(names)]
                    rs = await asyncio.gather(*(ac.post("/v1/completions", json=b) for b in bodies))
                    return names, bodies, [pieces(r.json()) for r in rs]

            names, bodies, texts = asyncio.run(mixed())
            refs = {"test-model": None, "alpha": a, "peft": p_ref}
            for name, b, text in zip(names, bodies, texts):
                assert text == want_pieces(tok, reference_tokens(base, refs[name], b["prompt"], 6)), name

            bad = tmp_path / "bad"
            bad.mkdir()
            (bad / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8}')
            r = c.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)})
            assert r.status_code == 400 and "adapter_model.safetensors" in r.text, r.text
            assert "bad" not in {m["id"] for m in c.get("/v1/models").json()["data"]}

            r = c.post("/v1/unload_lora_adapter", json={"lora_name": "peft"})
            assert r.status_code == 200, r.text
            r = c.post("/v1/completions", json={"model": "peft", "prompt": prompts[0], "max_tokens": 2})
            assert r.status_code == 404
            assert c.post("/v1/unload_lora_adapter", json={"lora_name": "peft"}).status_code == 404
            r = c.post("/v1/load_lora_adapter", json={"lora_name": "peft", "lora_path": str(p)})
            assert r.status_code == 200
            got = c.post("/v1/chat/completions", json={"model": "peft", "max_tokens": 4,
                                                      "messages": [{"role": "user", "content": "hi"}]})
            assert got.status_code == 200 and got.json()["model"] == "peft"


def test_models_file_names_adapters_per_model(tmp_path):
    base = model_path("qwen3")
    model, tok = mlx_lm.load(str(base))
    a = write_mlx_lm(tmp_path / "tone", model, 3)
    models = tmp_path / "models.toml"
    models.write_text(f'[models.base]\npath = "{base}"\nlora_modules = {{ tone = "{a}" }}\n')
    prompt = [11, 12, 13, 14, 15, 16]
    from dataclasses import replace

    from gateway.config import ServeConfig
    from gateway.models.spec import ModelsFileError, model_specs

    specs = [replace(s, name="test-model") for s in model_specs(ServeConfig(models_file=str(models)))]
    assert specs[0].lora_modules == (("tone", str(a)),)
    with live_server(base, specs=specs) as srv:
        with srv.client() as c:
            listed = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
            assert listed["tone"]["parent"] == "test-model"
            assert pieces(completion(c, "tone", prompt)) == want_pieces(tok, reference_tokens(base, a, prompt, 6))
    models.write_text(f'[models.base]\npath = "{base}"\nlora_modules = ["{a}"]\n')

    with pytest.raises(ModelsFileError, match="lora_modules must be a table"):
        model_specs(ServeConfig(models_file=str(models)))


def test_request_metrics_name_the_adapter(tmp_path):
    base = model_path("qwen3")
    model, _ = mlx_lm.load(str(base))
    a = write_mlx_lm(tmp_path / "a", model, 1)
    with live_server(base, lora_modules=[f"alpha={a}"]) as srv:
        with srv.client() as c:
            completion(c, "alpha", [5, 6, 7])
            r = c.post("/v1/embeddings", json={"model": "alpha", "input": "hello"})  # a clear refusal
            assert r.status_code == 400 and "adapters do not apply to embeddings" in r.json()["error"]["message"]
        wait_until(lambda: sample(srv.registry, "mlx_gateway_requests_total", tenant="default", model="alpha",
                                  endpoint="/v1/completions", status="200") == 1, 30,
                   "the request counted (after its answer is sent)")
        by_adapter = {"model": "test-model", "adapter": "alpha"}
        assert sample(srv.registry, "mlx_gateway_lora_requests_total", **by_adapter) == 1
        assert sample(srv.registry, "mlx_gateway_lora_prompt_tokens_total", **by_adapter) == 3
        assert sample(srv.registry, "mlx_gateway_lora_completion_tokens_total", **by_adapter) == 6
        assert sample(srv.registry, "mlx_gateway_lora_time_to_first_token_seconds_count", **by_adapter) == 1
        assert sample(srv.registry, "mlx_gateway_lora_adapters_resident", model="test-model") == 1
        assert sample(srv.registry, "mlx_gateway_lora_adapter_bytes", model="test-model") > 0
        assert sample(srv.registry, "mlx_gateway_lora_loads_total", model="test-model", result="loaded") == 1


def test_adapter_labels_are_bounded():
    from prometheus_client import CollectorRegistry

    from gateway.telemetry.lora_metrics import MAX_ADAPTER_LABELS, OTHER, LoraMetrics

    m = LoraMetrics(CollectorRegistry())
    assert [m.label(f"a{i}") for i in range(MAX_ADAPTER_LABELS)] == [f"a{i}" for i in range(MAX_ADAPTER_LABELS)]
    assert m.label("one-too-many") == OTHER and m.label("a0") == "a0"


def tenants_file(path, keys: dict) -> str:
    from gateway.tenancy.tenants import hash_key

    path.write_text(f"""
[admin]
key_sha256 = ["{hash_key(keys['admin'])}"]

[tenants.team]
key_sha256 = ["{hash_key(keys['team'])}"]
adapters = ["alpha", "team-*"]
default_adapter = "alpha"
manage_adapters = true

[tenants.plain]
key_sha256 = ["{hash_key(keys['plain'])}"]
models = ["test-model"]
adapters = []
""")
    return str(path)


def test_tenants_allow_adapters_give_a_default_one_and_may_manage_them(tmp_path):
    """A tenant's default adapter runs its requests for the base model; a tenant sees and
    uses only its adapters (others: 404, as a model it may not use); a tenant with
    ``manage_adapters`` loads and unloads its own, others may not (403)."""
    base = model_path("qwen3")
    model, tok = mlx_lm.load(str(base))
    a = write_mlx_lm(tmp_path / "a", model, 1)
    p, p_ref = write_peft(tmp_path / "p", model, 4)
    keys = {n: f"mgw-test-{n}-key" for n in ("admin", "team", "plain")}
    prompt = [21, 22, 23, 24, 25, 26, 27]
    with live_server(base, lora_modules=[f"alpha={a}"], tenants=tenants_file(tmp_path / "t.toml", keys)) as srv:
        with srv.client() as c:
            def as_(who):
                return {"Authorization": f"Bearer {keys[who]}"}

            def ask(who, name):
                return c.post("/v1/completions", headers=as_(who), json={
                    "model": name, "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 1})

            adapted = want_pieces(tok, reference_tokens(base, a, prompt, 6))
            plain = want_pieces(tok, reference_tokens(base, None, prompt, 6))
            r = ask("team", "test-model")  # the base model's name: the tenant's default adapter
            assert r.status_code == 200 and pieces(r.json()) == adapted, r.text
            assert pieces(ask("team", "alpha").json()) == adapted
            r = ask("plain", "test-model")
            assert r.status_code == 200 and pieces(r.json()) == plain
            r = ask("plain", "alpha")
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
            assert c.get("/v1/models/alpha", headers=as_("plain")).status_code == 404
            seen = {who: {m["id"] for m in c.get("/v1/models", headers=as_(who)).json()["data"]}
                    for who in ("team", "plain")}
            assert seen["team"] >= {"test-model", "alpha"} and "alpha" not in seen["plain"], seen

            load = {"lora_name": "team-p", "lora_path": str(p)}
            r = c.post("/v1/load_lora_adapter", headers=as_("plain"), json=load)
            assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied", r.text
            r = c.post("/v1/load_lora_adapter", headers=as_("team"), json={"lora_name": "other", "lora_path": str(p)})
            assert r.status_code == 403, r.text
            r = c.post("/v1/load_lora_adapter", headers=as_("team"), json=load)
            assert r.status_code == 200, r.text
            r = ask("team", "team-p")
            assert r.status_code == 200 and pieces(r.json()) == want_pieces(tok, reference_tokens(base, p_ref, prompt, 6))
            assert ask("plain", "team-p").status_code == 404
            r = c.post("/v1/unload_lora_adapter", headers=as_("plain"), json={"lora_name": "team-p"})
            assert r.status_code == 403, r.text
            r = c.post("/v1/unload_lora_adapter", headers=as_("team"), json={"lora_name": "alpha-x"})
            assert r.status_code == 404, r.text
            r = c.post("/v1/unload_lora_adapter", headers=as_("team"), json={"lora_name": "team-p"})
            assert r.status_code == 200, r.text
            assert ask("team", "team-p").status_code == 404
            r = c.post("/v1/unload_lora_adapter", headers=as_("admin"), json={"lora_name": "alpha"})
            assert r.status_code == 200, r.text
            r = ask("team", "test-model")  # its default adapter is not served now: the base
            assert r.status_code == 200 and pieces(r.json()) == plain


def test_the_memory_budget_counts_adapters(tmp_path):
    """Resident adapters are charged to their base model: one that does not fit unloads the
    least recently used idle adapter (read again when named), or is refused with a 503
    naming the budget while the others serve requests."""
    from mlx_lm.models.cache import make_prompt_cache

    from gateway.backend import weights_bytes
    from scheduler.admission.memory import gate_for
    from scheduler.lora.files import read_files

    base = model_path("qwen3")
    model, tok = mlx_lm.load(str(base))
    # an adapter outweighs the KV (and its copies) a streamed answer reserves, and the answer
    # outlasts the refused load of a third adapter however fast the machine decodes
    rank, streamed = 512, 1500
    a = write_mlx_lm(tmp_path / "a", model, 1, rank=rank)
    b = write_mlx_lm(tmp_path / "b", model, 2, rank=rank)
    d = write_mlx_lm(tmp_path / "d", model, 3, rank=rank)
    one = read_files(str(a)).nbytes
    prompt = [31, 32, 33, 34, 35]
    gate = gate_for(model, make_prompt_cache(model), 2048)  # what admission reserves (scheduler.admission.memory)
    reserved = gate.held([(len(prompt), streamed, gate.prefill_need(len(prompt)))])
    assert one > reserved  # so that two adapters (charged 5 times one) do not fit where one does
    # room for one adapter (charged 3 times its bytes) and a streamed answer's KV, not for two adapters
    budget = weights_bytes(model) + 4 * one + reserved
    with live_server(base, lora_modules=[f"alpha={a}", f"beta={b}"], memory_budget=budget,
                     max_lora_rank=rank) as srv:
        with srv.client() as c:
            def ask(name, n=4):
                r = c.post("/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": n,
                                                    "temperature": 0})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            ask("alpha")
            charged = sample(srv.registry, "mlx_gateway_lora_adapter_bytes", model="test-model")
            assert 3 * one <= charged < 3.1 * one
            assert ask("beta") == ask("beta")  # alpha (idle) was unloaded to make room
            assert sample(srv.registry, "mlx_gateway_lora_adapters_resident", model="test-model") == 1
            assert ask("alpha")  # read again, beta unloaded

            async def refused_while_alpha_runs():
                async with httpx.AsyncClient(base_url=srv.url, timeout=120) as ac:
                    started = asyncio.Event()

                    async def stream():  # read all along: a client that stops reading is dropped
                        body = {"model": "alpha", "prompt": prompt, "max_tokens": streamed, "temperature": 0,
                                "stream": True, "ignore_eos": True}
                        async with ac.stream("POST", "/v1/completions", json=body) as s:
                            async for line in s.aiter_lines():
                                if line.startswith("data: {"):
                                    started.set()

                    running = asyncio.create_task(stream())
                    await started.wait()
                    r = await ac.post("/v1/load_lora_adapter", json={"lora_name": "delta", "lora_path": str(d)})
                    assert not running.done()
                    running.cancel()
                    return r

            r = asyncio.run(refused_while_alpha_runs())
            assert r.status_code == 503 and r.json()["error"]["code"] == "memory_budget_exceeded", r.text
            assert "--memory-budget" in r.json()["error"]["message"]
            assert "delta" not in {m["id"] for m in c.get("/v1/models").json()["data"]}
            assert sample(srv.registry, "mlx_gateway_lora_loads_total", model="test-model", result="no_room") == 1


def test_next_turn_under_an_adapter_reuses_only_its_own_kv(tmp_path):
    """A conversation's next turn under an adapter is served from the KV computed under
    that adapter (its reply, the next-turn precompute) with the tokens of a cold run."""
    base = model_path("qwen3")
    model, _ = mlx_lm.load(str(base))
    a = write_mlx_lm(tmp_path / "a", model, 1)
    with live_server(base, lora_modules=[f"alpha={a}"]) as srv:
        with srv.client() as c:
            def chat(messages, name="alpha"):
                r = c.post("/v1/chat/completions", json={"model": name, "messages": messages, "max_tokens": 8,
                                                          "temperature": 0})
                assert r.status_code == 200, r.text
                return r.json()

            first = [{"role": "user", "content": "tell me about the apples and the pears"}]
            reply = chat(first)["choices"][0]["message"]["content"]
            assert srv.engine.wait_idle(60)
            second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]
            warm = chat(second)
            assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            assert chat(second, "test-model")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert srv.engine.wait_idle(60)
            srv.engine.flush_cache()
            cold = chat(second)
            assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
