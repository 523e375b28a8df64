"""Which models a gateway serves (``--model``, ``--models FILE``), the memory governor's
rule, and the byte bound shared by several models' prefix caches."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from cache import CacheBudget, PromptCacheManager
from gateway.config import ServeConfig, add_serve_arguments, config_from_args
from gateway.models.budget import Holder, NoRoom, plan_room
from gateway.models.spec import DEFAULT_NAME, DEMO_NAME, ModelsFileError, model_specs, parse_keep_alive

MODELS = """
[models.chat]
path = "demo"
aliases = ["small", "gpt-4o-mini"]
pin = true
keep_alive = "10m"
max_tokens = 1024
temp = 0.7
chat_template_args = { enable_thinking = false }
prompt_cache_bytes = "2G"

[models.coder]
path = "some/dir"
"""


def parse(*argv: str) -> ServeConfig:
    import argparse

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return config_from_args(p.parse_args(list(argv)))


@pytest.mark.parametrize("text, seconds", [("10m", 600.0), ("30s", 30.0), ("1h", 3600.0), ("0", 0.0), (0, 0.0),
                                           (90, 90.0), ("1.5m", 90.0), ("-1", None), (-1, None), ("2d", 172800.0)])
def test_keep_alive_durations(text, seconds):
    assert parse_keep_alive(text) == seconds


@pytest.mark.parametrize("bad", ["soon", "10x", "", True, [1], "inf"])
def test_bad_keep_alive_is_refused(bad):
    with pytest.raises(ValueError):
        parse_keep_alive(bad)


def test_a_models_file_gives_every_model_its_settings(tmp_path):
    f = tmp_path / "models.toml"
    f.write_text(MODELS)
    chat, coder = model_specs(parse("--models", str(f), "--max-tokens", "64", "--temp", "0.1"))
    assert (chat.name, chat.path, chat.aliases, chat.pin, chat.preload) == ("chat", "demo", ("small", "gpt-4o-mini"),
                                                                             True, True)
    assert (chat.keep_alive, chat.max_tokens, chat.temp, chat.prompt_cache_bytes) == (600.0, 1024, 0.7, 2 << 30)
    assert chat.chat_template_args == {"enable_thinking": False}
    # The flags are the defaults of what a table leaves out.
    assert (coder.pin, coder.preload, coder.keep_alive, coder.max_tokens, coder.temp) == (False, False, None, 64, 0.1)


@pytest.mark.parametrize("text, says", [
    ("[models.a]\npath = 'x'\nwhatever = 1\n", "unknown settings ['whatever']"),
    ("[models.a]\naliases = []\n", "path must be"),
    ("[models.a]\npath = 'x'\nkeep_alive = 'soon'\n", "keep_alive"),
    ("[models.a]\npath = 'x'\nmax_tokens = 0\n", "max_tokens must be >= 1"),
    ("[models.a]\npath = 'x'\ntemp = 'hot'\n", "temp must be a number"),
    ("[models.a]\npath = 'x'\npin = 'yes'\n", "pin must be true or false"),
    ("[models.a]\npath = 'x'\naliases = ['b']\n[models.b]\npath = 'y'\n", "'b' is given to models.a and models.b"),
    ("[servers]\n", "unknown sections"),
    ("not toml [", "not valid TOML"),
    ("", "no [models.NAME] table"),
])
def test_a_bad_models_file_is_refused_naming_the_setting(tmp_path, text, says):
    f = tmp_path / "models.toml"
    f.write_text(text)
    with pytest.raises(ModelsFileError, match=None) as e:
        model_specs(parse("--models", str(f)))
    assert says in str(e.value), str(e.value)


def test_log_level_takes_any_case():
    assert parse("--log-level", "info").log_level == "INFO"
    assert parse("--log-level", "Debug").log_level == "DEBUG"
    with pytest.raises(SystemExit):
        parse("--log-level", "loud")


def test_model_flags():
    assert [s.name for s in model_specs(parse())] == [DEFAULT_NAME]
    (one,) = model_specs(parse("--model", "demo", "--served-model-name", "x"))
    assert (one.name, one.aliases, one.pin, one.preload, one.keep_alive) == (DEMO_NAME, ("x",), True, True, None)
    a, b = model_specs(parse("--model", "a/one", "--model", "b/two", "--keep-alive", "5m"))
    assert [(s.name, s.pin, s.preload, s.keep_alive) for s in (a, b)] == [("a/one", False, True, 300.0),
                                                                         ("b/two", False, True, 300.0)]
    with pytest.raises(ModelsFileError, match="--served-model-name is for one model"):
        model_specs(parse("--model", "a", "--model", "b", "--served-model-name", "x"))
    with pytest.raises(ModelsFileError, match="not both"):
        model_specs(parse("--model", "a", "--models", "f.toml"))
    with pytest.raises(ModelsFileError, match="given to models.a and models.a"):
        model_specs(parse("--model", "a", "--model", "a"))


def test_serve_refuses_a_bad_models_file_before_any_work(tmp_path):
    f = tmp_path / "models.toml"
    f.write_text("[models.a]\npath = 'x'\nbogus = 1\n")
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--models", str(f), "--port", "9"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "models.a: unknown settings ['bogus']" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


# ---------------------------------------------------------------------- the governor's rule


def test_the_least_recently_used_idle_model_goes_first():
    holders = [Holder("old", 40, last_used=1.0), Holder("new", 40, last_used=5.0), Holder("mid", 40, last_used=3.0)]
    assert plan_room("x", 40, holders, budget=130) == ["old"]
    assert plan_room("x", 80, holders, budget=130) == ["old", "mid"]
    assert plan_room("x", 10, holders, budget=130) == []
    assert plan_room("x", 10, holders, budget=1000, max_loaded=2) == ["old", "mid"]


def test_pinned_loading_and_busy_models_are_never_unloaded():
    holders = [Holder("pinned", 50, last_used=1.0, pinned=True), Holder("busy", 30, last_used=2.0, in_flight=2),
               Holder("loading", 10, loading=True), Holder("idle", 20, last_used=9.0)]
    assert plan_room("x", 20, holders, budget=130) == []  # 110 + 20 fits
    assert plan_room("x", 30, holders, budget=130) == ["idle"]
    with pytest.raises(NoRoom) as e:
        plan_room("x", 50, holders, budget=130)
    msg = str(e.value)
    assert msg.startswith("cannot load the model 'x': it needs") and "--memory-budget" in msg
    assert "'pinned' (0.0 MB, pinned)" in msg and "'busy' (0.0 MB, 2 requests in flight)" in msg
    assert "'loading' (0.0 MB, loading)" in msg
    with pytest.raises(NoRoom, match="--max-loaded-models 3"):
        plan_room("x", 1, holders[:3], budget=10**9, max_loaded=3)


# ---------------------------------------------------------------------- one bound, several caches


def kv(tokens: int) -> list:
    c = KVCache()
    c.update_and_fetch(mx.zeros((1, 2, tokens, 8)), mx.zeros((1, 2, tokens, 8)))
    return [c]


def test_the_caches_of_several_models_share_one_bound_least_recently_used_first():
    per_snapshot = PromptCacheManager(1 << 30, 64)
    per_snapshot.insert("g", list(range(10)), kv(10))
    size = per_snapshot.nbytes
    budget = CacheBudget(3 * size)
    a = PromptCacheManager(1 << 30, 64, budget=budget)
    b = PromptCacheManager(1 << 30, 64, budget=budget)
    a.insert("g", list(range(10)), kv(10))
    b.insert("g", list(range(100, 110)), kv(10))
    a.insert("g", list(range(200, 210)), kv(10))
    assert budget.nbytes == 3 * size and a.num_entries == 2 and b.num_entries == 1
    hit = a.fetch("g", list(range(10)) + [7])  # a's oldest is used again: b's is now the oldest
    a.release(hit.lease)
    b.insert("g", list(range(300, 310)), kv(10))
    assert (a.num_entries, b.num_entries) == (2, 1)
    assert b.match_length("g", list(range(100, 110)) + [1]) == 0 and a.match_length("g", list(range(10)) + [1]) > 0
    assert b.metrics.evictions.labels(reason="budget")._value.get() == 1
    # A leased snapshot is never dropped: the sum may stay over the bound until it is released.
    held = a.fetch("g", list(range(200, 210)) + [1])
    assert budget.set_max_bytes(size) >= 2 and a.num_entries == 1 and budget.nbytes == size
    a.release(held.lease)
    a.close()
    b.close()
    assert budget.nbytes == 0
