"""Session affinity through the cluster front (``deploy/cluster/front.py``): a client's
session key (``user``/``safety_identifier``/``prompt_cache_key`` on chat, ``prompt_cache_key``
on Responses, ``metadata.user_id`` on Anthropic Messages) keeps a conversation on one
replica, so every turn meets its prefix cache, also after the router forgot its trees (a
restart) and while a third replica joins (it takes new sessions, not running ones).

For comparison, keyless chat conversations sent to the router alone: after its restart
the router's empty trees place each conversation again, on either replica; the figures are
printed (docs/cluster.md, "Session affinity").
"""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import pytest

from cluster_stack import Cluster, Replica, router_available, wait_for
from conftest import model_path
from gateway.tenancy.tenants import hash_key

WHY_NOT = router_available()
if WHY_NOT:
    pytest.skip(WHY_NOT, allow_module_level=True)

KEYED, KEYLESS = "mgw-affinity-keyed", "mgw-affinity-keyless"
TENANTS = f"""
[tenants.keyed]
key_sha256 = ["{hash_key(KEYED)}"]

[tenants.keyless]
key_sha256 = ["{hash_key(KEYLESS)}"]
"""
WORDS = "the river carries old boats past quiet towns while workers load grain and stone".split()


def system_prompt(i: int) -> str:
    rng = random.Random(i)
    return f"Session {i}. " + " ".join(rng.choice(WORDS) for _ in range(160))


class Session:
    """One conversation, sent turn after turn with its whole history (stateless), keyed
    by its protocol's session field; ``hits`` records (prompt tokens, cached tokens)."""

    def __init__(self, i: int, api: str, model: str, keyed: bool = True):
        self.i, self.api, self.model, self.keyed = i, api, model, keyed
        self.system = system_prompt(i)
        self.turns: list[tuple[str, str]] = []  # (role, text)
        self.hits: list[tuple[int, int]] = []

    def send(self, c: httpx.Client) -> None:
        self.turns.append(("user", f"turn {len(self.turns) // 2 + 1}: tell me more about item {self.i}"))
        msgs = [{"role": r, "content": t} for r, t in self.turns]
        if self.api == "messages":
            body = {"model": self.model, "max_tokens": 6, "system": self.system, "messages": msgs}
            if self.keyed:
                body["metadata"] = {"user_id": f"person-{self.i}"}
            r = c.post("/v1/messages", json=body)
            assert r.status_code == 200, r.text
            out = r.json()
            text = "".join(b.get("text", "") for b in out["content"])
            u = out["usage"]
            prompt = u["input_tokens"] + u.get("cache_read_input_tokens", 0) + u.get("cache_creation_input_tokens", 0)
            self.hits.append((prompt, u.get("cache_read_input_tokens", 0)))
        elif self.api == "responses":
            body = {"model": self.model, "max_output_tokens": 6, "instructions": self.system, "input": msgs,
                    "store": False}
            if self.keyed:
                body["prompt_cache_key"] = f"conversation-{self.i}"
            r = c.post("/v1/responses", json=body)
            assert r.status_code == 200, r.text
            out = r.json()
            text = "".join(p.get("text", "") for item in out["output"] if item["type"] == "message"
                           for p in item["content"])
            u = out["usage"]
            self.hits.append((u["input_tokens"], u["input_tokens_details"]["cached_tokens"]))
        else:
            body = {"model": self.model, "max_tokens": 6,
                    "messages": [{"role": "system", "content": self.system}] + msgs}
            if self.keyed:
                body["user" if self.i % 2 else "safety_identifier"] = f"person-{self.i}"
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            out = r.json()
            text = out["choices"][0]["message"]["content"] or ""
            u = out["usage"]
            self.hits.append((u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]))
        self.turns.append(("assistant", text or "ok"))

    def met_its_cache(self, turn: int) -> bool:
        """Whether ``turn`` (0-based) found the previous turn's whole prompt cached."""
        return self.hits[turn][1] >= self.hits[turn - 1][0] - 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("affinity")
    (tmp / "tenants.toml").write_text(TENANTS)
    with Cluster(tmp, model_path("qwen3"), 2, replica_args=["--max-tokens", "8", "--tenants",
                                                            str(tmp / "tenants.toml")]) as c:
        yield c


def test_sessions_stay_on_their_replica_through_a_router_restart_and_a_joining_replica(cluster, tmp_path):
    model = cluster.replicas[0].model
    keyed = [Session(i, api, model) for i, api in enumerate(["chat", "chat", "responses", "responses",
                                                             "messages", "messages"])]
    keyless = [Session(100 + i, "chat", model, keyed=False) for i in range(6)]
    front = httpx.Client(base_url=cluster.front.url, timeout=60, headers={"Authorization": f"Bearer {KEYED}"})
    router = httpx.Client(base_url=cluster.router.url, timeout=60, headers={"Authorization": f"Bearer {KEYLESS}"})
    r3 = None
    try:
        for _ in range(2):
            for s in keyed:
                s.send(front)
            for s in keyless:
                s.send(router)
        # the router forgets its trees
        cluster.router.kill()
        cluster.router.start()
        cluster.router.wait_healthy([r.url for r in cluster.replicas])
        # a third replica joins (it registers itself) and the front sees it
        r3 = Replica(tmp_path, Path(model), "--max-tokens", "8", "--router-url", cluster.router.url,
                     "--tenants", str(cluster.tmp / "tenants.toml"),
                     name="replica3").start()
        r3.wait_ready()
        cluster.router.wait_healthy([r3.url], timeout=15)
        cluster.front.wait_workers(3, timeout=10)
        # conversations come back in another order than they began (a router's empty trees
        # place them by order of arrival)
        rng = random.Random(7)
        for _ in range(2):
            for s in rng.sample(keyed, len(keyed)):
                s.send(front)
            for s in rng.sample(keyless, len(keyless)):
                s.send(router)
        # every turn after the first met its prefix cache: each session stayed on its replica
        for s in keyed:
            missed = [t for t in range(1, len(s.hits)) if not s.met_its_cache(t)]
            assert not missed, (s.api, s.i, s.hits)
        assert r3.metric("mlx_gateway_requests_total", tenant="keyed") == 0  # no running session moved to it
        # new sessions are spread over the three, the new one included
        n = [0]

        def one_lands_on_r3() -> bool:
            n[0] += 1
            Session(200 + n[0], ["chat", "responses", "messages"][n[0] % 3], model).send(front)
            return r3.metric("mlx_gateway_requests_total", tenant="keyed", status="200") > 0
        wait_for(one_lands_on_r3, 60, "a new session on the joining replica", interval=0)
        assert n[0] <= 20
        turn3 = sum(s.met_its_cache(2) for s in keyed) / len(keyed)
        turn3_router = sum(s.met_its_cache(2) for s in keyless) / len(keyless)
        later = [s.met_its_cache(t) for s in keyless for t in (1, 3)]
        print(f"\nfirst turn after the router's restart and the third replica's joining met its prefix cache: "
              f"front with session keys {turn3:.2f}, router alone (keyless chat) {turn3_router:.2f} "
              f"(its other turns {sum(later) / len(later):.2f}); {n[0]} new sessions until one went to the third")
    finally:
        front.close()
        router.close()
        if r3 is not None:
            r3.close()
