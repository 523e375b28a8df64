"""Every prompt-cache miss explained (gateway/telemetry/cache_explain.py): requests built
to miss for known causes, over real HTTP, with the cause the gateway reports checked in
the ``x-cache-miss`` header, ``GET /v1/cache/explain``, the request log and the counter."""

from __future__ import annotations

import json
import logging

import pytest

from conftest import live_server, model_path, sample, wait_until
from gateway.tenancy.tenants import hash_key

KEYS = {n: f"mgw-explain-{n}-key" for n in ("alice", "bob", "admin")}
TENANTS = f"""
[admin]
key_sha256 = ["{hash_key(KEYS['admin'])}"]

[tenants.alice]
key_sha256 = ["{hash_key(KEYS['alice'])}"]

[tenants.bob]
key_sha256 = ["{hash_key(KEYS['bob'])}"]
"""
FILLER = " ".join(f"Rule {w}: answer briefly and cite the {w} section." for w in
                  ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"))
TOOL = {"type": "function", "function": {"name": "read_file", "description": "Read a file of the project.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
TOOL2 = {"type": "function", "function": {"name": "list_dir", "description": "List a folder of the project.",
         "parameters": {"type": "object", "properties": {"folder": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("explain") / "tenants.toml"
    path.write_text(TENANTS)
    # no next-turn precompute: it would store prefixes after a test's flush (the eviction test)
    with live_server(model_path("qwen3", "qwen3"), tenants=str(path), max_tokens=3, log_format="json",
                     precompute_next_turn=False) as s:
        yield s


def chat(server, key: str, messages: list[dict], **extra):
    """POST a chat; (reply text, cause, header, request id)."""
    with server.client() as c:
        r = c.post("/v1/chat/completions", headers={"Authorization": f"Bearer {KEYS[key]}"},
                   json={"model": "test-model", "messages": messages, "max_tokens": 3, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    header = r.headers["x-cache-miss"]
    return r.json()["choices"][0]["message"]["content"] or "", header.split(";")[0], header, r.headers["x-request-id"]


def explained(server, key: str, rid: str) -> dict:
    with server.client() as c:
        r = c.get("/v1/cache/explain", params={"request_id": rid}, headers={"Authorization": f"Bearer {KEYS[key]}"})
    assert r.status_code == 200, r.text
    return r.json()


def system(text: str) -> dict:
    return {"role": "system", "content": text}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_a_first_request_was_never_seen_and_its_next_turn_hits(server):
    msgs = [system("You are the first assistant. " + FILLER), user("Name a colour.")]
    reply, cause, header, rid = chat(server, "alice", msgs)
    assert cause == "never_seen", header
    turn2 = msgs + [{"role": "assistant", "content": reply}, user("And another one?")]
    _, cause, header, rid = chat(server, "alice", turn2)
    assert cause == "none", header  # only the new turn is new
    got = explained(server, "alice", rid)
    assert got["cause"] == "none" and got["cached_tokens"] > 0 and got["at"] >= got["cached_tokens"]


def test_a_date_in_the_system_prompt_that_changes(server):
    base = "You are a coding agent. Today's date is {}. " + FILLER
    chat(server, "alice", [system(base.format("2025-03-14")), user("List the tests.")])
    _, cause, header, rid = chat(server, "alice", [system(base.format("2025-03-15")), user("List the tests.")])
    assert cause == "changing_value", header
    got = explained(server, "alice", rid)
    assert got["part"] == "system" and got["message"] == 0, got
    assert "14" in got["detail"] and "15" in got["detail"], got
    assert got["prompt"].startswith("5") and got["cached"].startswith("4"), got  # the excerpts at the divergence


def test_a_tool_added(server):
    msgs = [system("You are the tool agent. " + FILLER), user("Read the README.")]
    chat(server, "alice", msgs, tools=[TOOL])
    _, cause, header, rid = chat(server, "alice", msgs, tools=[TOOL, TOOL2])
    assert cause == "tools_changed", header
    assert explained(server, "alice", rid)["part"] == "tools"


def test_an_edited_earlier_turn(server):
    msgs = [system("You are the editing agent. " + FILLER), user("Tell me about cats and their habits.")]
    reply, _, _, _ = chat(server, "alice", msgs)
    turn2 = msgs + [{"role": "assistant", "content": reply}, user("Go on.")]
    chat(server, "alice", turn2)
    edited = [msgs[0], user("Tell me about owls and their habits."), *turn2[2:], user("More.")]
    _, cause, header, rid = chat(server, "alice", edited)
    assert cause == "earlier_turn_edited", header
    got = explained(server, "alice", rid)
    assert got["part"] == "message" and got["message"] == 1 and got["role"] == "user", got


def test_another_tenants_cache_group(server):
    msgs = [system("You are the shared agent. " + FILLER), user("Say hello.")]
    chat(server, "alice", msgs)
    _, cause, header, rid = chat(server, "bob", msgs)
    assert cause == "other_tenant", header
    got = explained(server, "bob", rid)
    assert "cached" not in got  # nothing of the other group's text is shown
    # the explanation is the tenant's own: another tenant's key gets 404, an admin's sees it
    with server.client() as c:
        r = c.get("/v1/cache/explain", params={"request_id": rid}, headers={"Authorization": f"Bearer {KEYS['alice']}"})
        assert r.status_code == 404, r.text
        r = c.get("/v1/cache/explain", headers={"Authorization": f"Bearer {KEYS['admin']}"})
        assert r.status_code == 200 and any(w["request_id"] == rid for w in r.json()["data"])
    assert sample(server.registry, "mlx_gateway_cache_misses_total", tenant="bob", model="test-model",
                  cause="other_tenant") >= 1


def test_an_evicted_prefix(server):
    msgs = [system("You are the evicted agent. " + FILLER), user("Count to three.")]
    chat(server, "alice", msgs)
    with server.client() as c:
        r = c.post("/admin/cache/flush", headers={"Authorization": f"Bearer {KEYS['admin']}"}, json={})
        assert r.status_code == 200, r.text
    _, cause, header, rid = chat(server, "alice", msgs)
    assert cause == "evicted", header
    assert explained(server, "alice", rid)["evicted_at"] > 0


def test_the_request_log_says_why(server, caplog):
    caplog.set_level(logging.INFO, logger="mlx_gateway.requests")
    msgs = [system("Logged agent here. " + FILLER), user("Hi.")]
    _, _, _, rid = chat(server, "alice", msgs)

    def logged() -> list[dict]:  # (the line is written once the response has gone out: it may follow it)
        records = [getattr(r, "record", {}) for r in caplog.records if r.name == "mlx_gateway.requests"]
        return [r for r in records if r.get("request_id") == rid]

    mine = wait_until(logged, 10, "the request's log line")
    assert mine[0]["cache_miss"]["cause"] == "never_seen", mine
    assert "Logged agent" not in json.dumps(mine[0])  # the record stays JSON, with no prompt text
    assert not {"before", "prompt", "cached"} & set(mine[0]["cache_miss"])  # those need --log-prompts


def test_no_checkpoint_on_a_recurrent_model():
    """A recurrent cache restores only where a snapshot was taken: a prompt sharing more
    than that (inside a message) is told so."""
    with live_server(model_path("mamba2"), max_tokens=3) as s:
        def ask(text):
            with s.client() as c:
                r = c.post("/v1/chat/completions", json={"model": "test-model", "max_tokens": 3, "messages": [
                    system("You are the recurrent agent. " + FILLER), user(text)]})
            assert r.status_code == 200, r.text
            return r.headers["x-cache-miss"]

        ask("Please summarise the following notes about the garden: roses, tulips, daisies.")
        header = ask("Please summarise the following notes about the garden: ferns, mosses, lichens.")
        assert header.startswith("no_checkpoint;"), header
        assert "part=message" in header and "message=1" in header, header


def test_a_tool_added_on_a_template_that_renders_tools_in_the_user_turn():
    """Llama 3.1's template writes the tools into the first user message (and a line into
    the system header): the cause comes from the previous request's tools, not the span."""
    with live_server(model_path("llama"), max_tokens=3, precompute_next_turn=False) as s:
        def ask(tools):
            with s.client() as c:
                r = c.post("/v1/chat/completions", json={"model": "test-model", "max_tokens": 3, "tools": tools,
                           "messages": [system("You are the llama agent. " + FILLER), user("Read the README.")]})
            assert r.status_code == 200, r.text
            return r.headers["x-cache-miss"]

        ask([TOOL])
        header = ask([TOOL, TOOL2])
        assert header.startswith("tools_changed;"), header
