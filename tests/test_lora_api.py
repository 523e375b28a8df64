"""LoRA adapters over HTTP, vLLM's interface: ``--lora-modules``, ``model: NAME`` in the
APIs, ``/v1/models`` with ``parent``, ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
import mlx_lm

from conftest import live_server, model_path
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
    from conftest import sample

    base = model_path("qwen3")
    model, _ = mlx_lm.load(str(base))
    a = write_mlx_lm(tmp_path / "a", model, 1)
    with live_server(base, lora_modules=[f"alpha={a}"]) as srv:
        with srv.client() as c:
            completion(c, "alpha", [5, 6, 7])
        assert sample(srv.registry, "mlx_gateway_requests_total", tenant="default", model="alpha",
                      endpoint="/v1/completions", status="200") == 1


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
