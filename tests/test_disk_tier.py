"""The prompt cache's disk tier end to end, through real gateways serving real tiny models.

A gateway started with ``--prompt-cache-dir`` writes evicted snapshots to disk while it
serves, and its whole cache at a graceful stop; a gateway started later on the same
directory serves a prompt whose prefix is on disk from it (``cached_tokens``, the disk
read counter, ``cache_source`` in the request log), with the same greedy answer as a
gateway without a disk tier. Entries never cross models or cache groups. SIGTERM and
SIGKILL are sent to ``mlx-gateway serve`` subprocesses; the rest runs in-process
(``live_server``, whose stop is graceful, so it persists like SIGTERM does).

The store itself (corrupt files, a crash in a write, a full disk, permissions) is
covered by ``test_disk_store.py``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conftest import free_port, live_server, model_path, sample, start_gateway, wait_until
from gateway.models.demo_model import build_model_dir
from gateway.tenancy.tenants import hash_key

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")

CLI = [sys.executable, "-m", "gateway.cli"]
READS = "mlx_gateway_prompt_cache_disk_reads_total"
WRITES = "mlx_gateway_prompt_cache_disk_writes_total"
ENTRIES = "mlx_gateway_prompt_cache_disk_entries"
SUFFIX = ".safetensors"

WORDS = ("the model cache token prompt server batch request tenant prefix memory metal apple code agent "
         "browser extension stream answer question system user assistant reason think water light house "
         "world number sound people first little great small large picture mother animal").split()


def text(seed: int, n_words: int) -> str:
    """``n_words`` words of the tiny tokenizer's corpus, fixed by ``seed``."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def cached(resp: dict) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def chat_body(model: str, messages: list[dict], max_tokens: int = 12) -> dict:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}


def completion_body(model: str, prompt: str, max_tokens: int = 8) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


def answer(resp: dict) -> str:
    choice = resp["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def post(client: httpx.Client, path: str, body: dict, **kw) -> dict:
    r = client.post(path, json=body, **kw)
    assert r.status_code == 200, r.text
    return r.json()


def cold_answer(model_dir: Path, path: str, body: dict) -> dict:
    """What a fresh gateway without a disk tier answers (in-process; ``model`` is renamed)."""
    with live_server(model_dir, precompute_next_turn=False) as s, s.client() as c:
        return post(c, path, dict(body, model="test-model"))


def modes(root: Path) -> dict[str, int]:
    """Permission bits of ``root`` and everything below it, by path relative to ``root``."""
    out = {".": stat.S_IMODE(os.stat(root).st_mode)}
    for p in root.rglob("*"):
        out[str(p.relative_to(root))] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


def entry_files(root: Path) -> dict[str, int]:
    """Entry files (path relative to ``root`` -> size) of every model directory in ``root``."""
    return {str(p.relative_to(root)): p.stat().st_size for p in root.glob(f"*/*{SUFFIX}")}


class Gateway:
    """An ``mlx-gateway serve`` subprocess with a JSON log file, started with umask 0 (the
    disk tier must set its modes itself)."""

    def __init__(self, tmp: Path, model_dir: Path, *args: str, name: str = "gw"):
        self.port = free_port()
        self.model = str(model_dir)
        self.log_path = tmp / f"{name}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [*CLI, "serve", "--model", self.model, "--port", str(self.port), "--log-format", "json", *args],
            stdout=self._log, stderr=subprocess.STDOUT, umask=0)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=120)

    def health(self) -> httpx.Response | None:
        if self.proc.poll() is not None:
            raise AssertionError(f"the gateway exited with {self.proc.returncode}:\n{self.log_text()}")
        try:
            return self.client.get("/health")
        except httpx.TransportError:
            return None

    def wait_ready(self) -> None:
        wait_until(lambda: (r := self.health()) is not None and r.status_code == 200, 120,
                   "the gateway to load its model", interval=0.05)

    def metric(self, name: str, **labels) -> float:
        """A sample of ``/metrics`` (0 when absent)."""
        return sample(self.client.get("/metrics").text, name, **labels)

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def records(self) -> list[dict]:
        return [json.loads(x) for x in self.log_text().splitlines() if x.startswith("{")]

    def signal(self, sig: int, timeout: float = 60) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def close(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._log.close()


@pytest.fixture
def gateways():
    """Start gateways with ``gateways(tmp, model, *args)``; every one is killed at the end."""
    started: list[Gateway] = []

    def start(*a, **kw) -> Gateway:
        g = Gateway(*a, **kw)
        started.append(g)
        return g

    yield start
    for g in started:
        g.close()


# ------------------------------------------------------------------------- SIGTERM


def test_sigterm_restart_serves_the_next_turn_from_disk(tmp_path, gateways):
    model = model_path("qwen3")
    cache_dir = tmp_path / "pcache"
    cache_dir.mkdir()
    os.chmod(cache_dir, 0o755)  # the tier must tighten an existing directory to 0700

    first = gateways(tmp_path, model, "--prompt-cache-dir", str(cache_dir), name="first")
    first.wait_ready()
    messages = [{"role": "user", "content": text(1, 90)}]
    for turn in range(3):
        r = post(first.client, "/v1/chat/completions", chat_body(first.model, messages))
        if turn:
            assert cached(r) > 0, "the conversation's earlier turns should hit the memory cache"
        messages += [{"role": "assistant", "content": answer(r)},
                     {"role": "user", "content": f"and the {WORDS[turn]} {WORDS[turn + 5]}?"}]
    assert first.metric(READS, outcome="hit") == 0

    assert first.signal(signal.SIGTERM) == 0, first.log_text()
    assert any(r["message"].startswith("wrote ") and "snapshots to disk" in r["message"] for r in first.records())
    files = entry_files(cache_dir)
    assert files, "a graceful stop should have written the cache to disk"
    for rel, mode in modes(cache_dir).items():
        is_dir = (cache_dir / rel).is_dir()
        assert mode == (0o700 if is_dir else 0o600), f"{rel}: mode {mode:o}"

    second = gateways(tmp_path, model, "--prompt-cache-dir", str(cache_dir), name="second")
    second.wait_ready()
    assert second.metric(ENTRIES) == len(files)
    hits_before = second.metric(READS, outcome="hit")
    body = chat_body(second.model, messages)
    r = post(second.client, "/v1/chat/completions", body)
    usage = r["usage"]
    assert cached(r) >= 0.9 * usage["prompt_tokens"], usage
    assert second.metric(READS, outcome="hit") > hits_before
    assert second.metric(READS, outcome="corrupt") == 0

    cold = cold_answer(model, "/v1/chat/completions", body)
    assert cached(cold) == 0 and cold["usage"]["prompt_tokens"] == usage["prompt_tokens"]
    assert answer(r) == answer(cold), "a prefix restored from disk must give the cold gateway's greedy answer"
    assert r["usage"]["completion_tokens"] == cold["usage"]["completion_tokens"]


# ------------------------------------------------------------------------- SIGKILL


def kv_bytes_per_token(model_dir: Path) -> int:
    """Bytes of full-attention KV one token takes in the tiny float32 model."""
    cfg = json.loads((model_dir / "config.json").read_text())
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4


def test_sigkill_keeps_the_snapshots_written_while_serving(tmp_path, gateways):
    model = model_path("qwen3")
    cache_dir = tmp_path / "pcache"
    # Distinct first words: the prompts share no token. (PromptCacheManager.insert pins the
    # tree node a new key diverges inside, so a prompt sharing even its first token with
    # the one stored snapshot is refused instead of evicting it, and nothing reaches disk.)
    prompts = [f"{first} {text(100 + i, 120)}" for i, first in enumerate(("apple", "browser", "code"))]
    max_tokens = 8
    # Measure one prompt's length on a cold gateway, then bound the memory tier to 1.5
    # such snapshots: each new prompt evicts the one before, which goes to disk.
    ref = cold_answer(model, "/v1/completions", completion_body("", prompts[0], max_tokens))
    snapshot = (ref["usage"]["prompt_tokens"] + max_tokens) * kv_bytes_per_token(model)
    memory_bytes = int(1.5 * snapshot)

    g = gateways(tmp_path, model, "--prompt-cache-dir", str(cache_dir),
                 "--prompt-cache-bytes", str(memory_bytes), name="killed")
    g.wait_ready()
    first = post(g.client, "/v1/completions", completion_body(g.model, prompts[0], max_tokens))
    assert answer(first) == answer(ref)
    for p in prompts[1:]:
        assert cached(post(g.client, "/v1/completions", completion_body(g.model, p, max_tokens))) == 0
    assert g.metric("mlx_gateway_prompt_cache_evictions_total", reason="bytes") >= 1
    wait_until(lambda: g.metric(WRITES, outcome="written") >= 1, 30, "an evicted snapshot to be written")
    assert g.signal(signal.SIGKILL) == -signal.SIGKILL

    files = entry_files(cache_dir)
    assert files
    # What a crash in the middle of a write leaves: a partial temp file beside the entries.
    (model_dir,) = {p.parent for p in cache_dir.glob(f"*/*{SUFFIX}")}
    some = next(model_dir.glob(f"*{SUFFIX}")).read_bytes()
    (model_dir / ".tmp-0123456789abcdef").write_bytes(some[: len(some) // 2])

    again = gateways(tmp_path, model, "--prompt-cache-dir", str(cache_dir), name="restarted")
    again.wait_ready()
    assert not list(model_dir.glob(".tmp-*")), "a restart must remove leftover temp files"
    assert again.metric(ENTRIES) == len(files) and again.metric(READS, outcome="corrupt") == 0
    body = completion_body(again.model, prompts[0] + " " + text(7, 6), max_tokens)
    r = post(again.client, "/v1/completions", body)
    assert cached(r) >= 0.9 * first["usage"]["prompt_tokens"], r["usage"]
    assert again.metric(READS, outcome="hit") >= 1
    cold = cold_answer(model, "/v1/completions", body)
    assert cached(cold) == 0
    assert answer(r) == answer(cold)


# ------------------------------------------------------------------------- isolation


def twin_model() -> Path:
    """A tiny qwen3 with the same config and tokenizer as ``model_path("qwen3")`` but other
    weights: the same prompt gives the same tokens, the cache must still not be shared."""
    base = model_path("qwen3")
    return build_model_dir(base.parent / f"{base.name}-seed1", "qwen3", tokenizer_dir=base, seed=1)


def test_entries_of_one_model_are_never_served_to_another(tmp_path):
    model_a, model_b = model_path("qwen3"), twin_model()
    assert (model_a / "config.json").read_text() == (model_b / "config.json").read_text()
    assert (model_a / "model.safetensors").read_bytes() != (model_b / "model.safetensors").read_bytes()
    cache_dir = tmp_path / "pcache"
    prompt = text(3, 120)
    body = completion_body("test-model", prompt)
    longer = completion_body("test-model", prompt + " " + text(4, 5))

    with live_server(model_a, prompt_cache_dir=str(cache_dir)) as s, s.client() as c:
        a = post(c, "/v1/completions", body)
    files_a = entry_files(cache_dir)
    assert files_a, "the graceful stop should have written model A's cache"

    with live_server(model_b, prompt_cache_dir=str(cache_dir)) as s, s.client() as c:
        assert sample(s.registry, ENTRIES) == 0, "model B must not see model A's entries"
        b = post(c, "/v1/completions", body)
        assert b["usage"]["prompt_tokens"] == a["usage"]["prompt_tokens"]  # same tokens...
        assert cached(b) == 0  # ...yet nothing cached
        b2 = post(c, "/v1/completions", longer)
        assert sample(s.registry, READS, outcome="hit") == 0
        assert cached(b2) > 0  # B's own memory cache works
    files = entry_files(cache_dir)
    assert {k: v for k, v in files.items() if k in files_a} == files_a, "model A's entries must be kept"
    assert len({Path(k).parent for k in files}) == 2, "each model keeps its own directory"

    with live_server(model_a, prompt_cache_dir=str(cache_dir)) as s, s.client() as c:
        r = post(c, "/v1/completions", longer)
        assert cached(r) >= 0.9 * a["usage"]["prompt_tokens"], r["usage"]
        assert sample(s.registry, READS, outcome="hit") == 1


KEYS = {"alice": "mgw-test-disk-alice", "bob": "mgw-test-disk-bob"}


def test_entries_of_one_cache_group_are_never_served_to_another(tmp_path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text("".join(
        f'[tenants.{name}]\nkey_sha256 = ["{hash_key(key)}"]\ncache_group = "group-{name}"\n\n'
        for name, key in KEYS.items()))
    cache_dir = tmp_path / "pcache"
    model = model_path("qwen3")
    messages = [{"role": "user", "content": text(5, 100)}]
    auth = {name: {"Authorization": f"Bearer {key}"} for name, key in KEYS.items()}

    with live_server(model, tenants=str(tenants), prompt_cache_dir=str(cache_dir)) as s, s.client() as c:
        first = post(c, "/v1/chat/completions", chat_body("test-model", messages), headers=auth["alice"])
        messages += [{"role": "assistant", "content": answer(first)}, {"role": "user", "content": "why so?"}]
        assert s.engine.wait_idle(30)  # the next-turn precompute is stored before the stop writes it
    assert entry_files(cache_dir)

    body = chat_body("test-model", messages)
    with live_server(model, tenants=str(tenants), prompt_cache_dir=str(cache_dir)) as s, s.client() as c:
        assert sample(s.registry, ENTRIES) >= 1
        bob = post(c, "/v1/chat/completions", body, headers=auth["bob"])
        assert cached(bob) == 0, "bob's cache group must not read alice's entries"
        assert sample(s.registry, READS, outcome="hit") == 0
        alice = post(c, "/v1/chat/completions", body, headers=auth["alice"])
        assert cached(alice) >= 0.9 * alice["usage"]["prompt_tokens"], alice["usage"]
        assert sample(s.registry, READS, outcome="hit") == 1
    assert answer(alice) == answer(bob), "alice's disk hit must give bob's cold answer"


# ------------------------------------------------------------------------- errors and logs


def test_an_unusable_cache_dir_stops_the_start_with_a_clear_error(tmp_path, gateways):
    not_a_dir = tmp_path / "cache-file"
    not_a_dir.write_text("not a directory\n")
    g = gateways(tmp_path, model_path("qwen3"), "--prompt-cache-dir", str(not_a_dir), name="baddir")
    assert g.proc.wait(120) != 0  # before loading the model
    out = g.log_text()
    assert str(not_a_dir) in out and "not a directory" in out, out
    assert not_a_dir.read_text() == "not a directory\n"


def test_a_cache_dir_in_use_by_another_gateway_is_reported(tmp_path):
    from dataclasses import replace

    from gateway.config import ServeConfig
    from gateway.models.spec import model_specs

    cache_dir = tmp_path / "pcache"
    model = model_path("qwen3")
    with live_server(model, prompt_cache_dir=str(cache_dir)):
        # The same files under the same name: the same cache directory (the served name is
        # part of it, so the same files under another name do not collide).
        cfg = ServeConfig(model=str(model), prompt_cache_dir=str(cache_dir))
        gw = start_gateway(cfg, [replace(s, name="test-model") for s in model_specs(cfg)], wait=False)
        try:
            status, why = wait_until(lambda: gw.models.startup()[0] != "loading" and gw.models.startup(), 120,
                                     "the load to end")
            assert status == "error" and gw.models.handles() == []
            assert "in use" in why and str(cache_dir) in why, why
        finally:
            gw.stop()


def test_request_log_names_the_disk_as_the_cache_source(tmp_path, caplog):
    cache_dir = tmp_path / "pcache"
    model = model_path("qwen3")
    prompt = text(9, 120)
    with live_server(model, prompt_cache_dir=str(cache_dir)) as s, s.client() as c:
        post(c, "/v1/completions", completion_body("test-model", prompt))
    assert entry_files(cache_dir)

    caplog.set_level(logging.INFO, logger="mlx_gateway.requests")
    body = completion_body("test-model", prompt + " " + text(10, 5))

    def records() -> list[dict]:
        return [r.record for r in caplog.records if r.name == "mlx_gateway.requests" and hasattr(r, "record")]

    with live_server(model, prompt_cache_dir=str(cache_dir)) as s, s.client() as c:
        r = post(c, "/v1/completions", body)
        (line,) = wait_until(records, 10, "the request log line")
        assert line["cache_source"] == "disk" and line["cached_tokens"] == cached(r) > 0, line
        r2 = post(c, "/v1/completions", body)  # the same prompt again: now from memory
        second = wait_until(lambda: records()[1:], 10, "the second request log line")[0]
        assert second["cache_source"] == "memory" and second["cached_tokens"] == cached(r2) > 0, second
