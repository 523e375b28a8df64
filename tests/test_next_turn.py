"""Next-turn precompute: when a chat reply ends, the prefix the next request will share
is prefilled at the lowest priority. Checked with real chat templates (the prefix is
exactly what any next request shares), through the serving path on every cache type
(the next turn restores the precomputed prefix and still answers exactly like a cold
run), and with a request arriving while a precompute runs (it is preempted, and the
request is exact)."""

from __future__ import annotations

import pytest

from cache.checkpoints import common_prefix
from conftest import TOKENIZERS, EventSink, assert_same_tokens, live_server, load_tokenizer, model_path, sample, wait_until
from gateway.conversation.next_turn import next_turn_prefix
from gateway.conversation.templates import render_text
from scheduler.request import EngineRequest, SamplingParams, TokenEvent

SYSTEM = "You are terse. You answer questions about caches."
U1 = "What is a prefix cache, and why would a server keep one?"
REPLY = "It keeps computed prompt state, so a repeated prefix is not computed again."


def conversation(extra: str = "") -> list[dict]:
    return [{"role": "system", "content": SYSTEM + extra}, {"role": "user", "content": U1}]


@pytest.mark.parametrize("family,kw", [("qwen3", {}), ("qwen3", {"enable_thinking": False}),
                                       ("llama3", {}), ("gemma3", {})])
def test_prefix_is_what_every_next_request_shares(family, kw):
    tok = load_tokenizer(TOKENIZERS / family)
    msgs = conversation()
    prefix = next_turn_prefix(tok, msgs, kw, REPLY)
    nexts = []
    for user in ("And how is it evicted?", "Zebra crossing, 42 times.", " leading space"):
        m = [*msgs, {"role": "assistant", "content": REPLY}, {"role": "user", "content": user}]
        nexts.append(list(tok.apply_chat_template(m, tokenize=True, add_generation_prompt=True, **kw)))
    assert all(n[:len(prefix)] == prefix for n in nexts[:2])
    assert len(prefix) == common_prefix(nexts[0], nexts[1])  # all of it, not less
    text = tok.decode(prefix)
    assert text.endswith(("user\n", "user<|end_header_id|>\n\n"))
    assert REPLY in text and "<think>" not in text.split(U1)[-1]


def test_template_that_rejects_the_next_turn_gives_nothing():
    tok = load_tokenizer(TOKENIZERS / "gemma3")  # Gemma's template requires alternating roles
    msgs = [{"role": "user", "content": U1}, {"role": "assistant", "content": "a"}, {"role": "assistant",
                                                                                       "content": "b"}]
    with pytest.raises(Exception):
        render_text(tok, msgs, True)
    assert next_turn_prefix(tok, msgs[:2], {}, REPLY) is None



def chat(client, messages, max_tokens=8, **extra):
    body = {"model": "test-model", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": True, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    lp = [(t["token"], t["logprob"]) for t in out["choices"][0]["logprobs"]["content"]]
    return out["choices"][0]["message"]["content"], lp, out["usage"]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "gemma3_text", "nemotron_h"])
def test_next_turn_uses_the_precomputed_prefix_and_matches_cold(arch):
    with live_server(model_path(arch), prefill_budget=1e-4) as server:
        reg, tok, engine = server.registry, server.tokenizer, server.engine
        stored = lambda: sample(reg, "mlx_gateway_precompute_total", outcome="stored")  # noqa: E731
        with server.client() as c:
            msgs = conversation(" Be exact." * 8)
            reply, _, _ = chat(c, msgs, max_tokens=16)
            assert engine.wait_idle(60) and stored() == 1  # idle only once the precompute is done
            prefix = next_turn_prefix(tok, msgs, {}, reply)
            msgs2 = [*msgs, {"role": "assistant", "content": reply}, {"role": "user", "content": "Why?"}]
            _, warm, usage = chat(c, msgs2)
            assert usage["prompt_tokens_details"]["cached_tokens"] == len(prefix)
            assert sample(reg, "mlx_gateway_precompute_tokens_total", outcome="used") > 0
            wait_until(lambda: engine.wait_idle(1) and stored() == 2, 60, "the second precompute")
            engine.flush_cache()
            _, cold, usage = chat(c, msgs2)
            assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert_same_tokens(warm, cold, f"{arch}: next turn from the precomputed prefix")


def test_no_precompute_while_streams_decode():
    """A reply that ends while another stream decodes is precomputed only once the engine
    has nothing else to do."""
    with live_server(model_path("qwen3")) as server:
        reg, engine = server.registry, server.engine
        no_eos = {str(t): -100 for t in server.tokenizer.eos_token_ids}
        body = {"model": "test-model", "messages": conversation(), "max_tokens": 1000, "temperature": 0,
                "stream": True, "logit_bias": no_eos}
        with server.client() as c, c.stream("POST", "/v1/chat/completions", json=body) as long_stream:
            lines = long_stream.iter_lines()
            next(line for line in lines if line.startswith("data: {"))  # decoding now
            chat(c, [{"role": "user", "content": "Short one."}], max_tokens=4)
            for _ in range(20):  # engine steps while the long stream decodes
                assert not engine.call(lambda: any(a.precompute is not None for a in engine.core.batch.active.values()))
            assert engine.call(lambda: len(engine.core.batch.active)) >= 1  # the long stream was still decoding
            assert sample(reg, "mlx_gateway_precompute_total", outcome="stored") == 0
            for _ in lines:  # read to its end
                pass
        assert engine.wait_idle(60)
        outcomes = {o: sample(reg, "mlx_gateway_precompute_total", outcome=o) for o in ("stored", "cached", "failed", "dropped", "preempted")}
        assert outcomes["stored"] == 2, str(outcomes)


def test_a_request_preempts_a_running_precompute():
    """A long reply's precompute runs in 32-token chunks. A request submitted between two
    of its steps (from inside the engine's own call, so the timing is certain) drops it at
    the next step, and gets exactly the tokens and logprobs of a cold run."""
    with live_server(model_path("qwen3_5"), prefill_budget=1e-4) as server:
        reg, engine, tok = server.registry, server.engine, server.tokenizer
        no_eos = {str(t): -100 for t in tok.eos_token_ids}
        with server.client() as c:
            reply, _, _ = chat(c, conversation(), max_tokens=400, logit_bias=no_eos)
        other = list(tok.encode("Something else entirely, about " + "memory " * 30))

        def run(cold: bool):
            sink = EventSink()
            req = EngineRequest(f"other-{cold}", other, SamplingParams(max_tokens=8, logprobs=True), sink)

            def submit_if_precompute_runs():
                if not cold and not any(a.precompute is not None for a in engine.core.batch.active.values()):
                    return False
                engine.submit(req)
                return True

            wait_until(lambda: engine.call(submit_if_precompute_runs), 60, "a precompute step")
            assert sink.done.wait(60)
            return [(e.token, e.logprob) for e in sink.events if isinstance(e, TokenEvent)]

        warm = run(cold=False)
        assert sample(reg, "mlx_gateway_precompute_total", outcome="preempted") == 1
        prefix = next_turn_prefix(tok, conversation(), {}, reply)
        held = engine.call(lambda: engine.prompt_cache.match_length("default", [*prefix, -1]))
        assert held < len(prefix) - 32  # dropped, not finished
        assert engine.wait_idle(60)
        engine.flush_cache()
        cold = run(cold=True)
    assert len(warm) == 8
    assert_same_tokens(warm, cold, "request that preempted a precompute")
