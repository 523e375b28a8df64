"""The ``mlx-gateway`` command as users run it: keys, refusing an open public host or a
response store it cannot use, reloading the tenants file on SIGHUP without dropping a
request in flight, and ``demo-model`` writing only models its server loads."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from conftest import TOKENIZERS, free_port, live_server, model_path, require_tokenizers, wait_until

CLI = [sys.executable, "-m", "gateway.cli"]


def keys_new(tenant: str) -> tuple[str, str, str]:
    """``mlx-gateway keys new tenant``: its output, the key and the ``key_sha256`` line."""
    out = subprocess.run([*CLI, "keys", "new", tenant], capture_output=True, text=True, check=True).stdout
    key = re.search(r"(mgw-\S+)", out).group(1)
    line = re.search(r'^key_sha256 = \["[0-9a-f]{64}"\]$', out, re.M).group(0)
    assert f"[tenants.{tenant}]" in out
    return out, key, line


def new_key(tenant: str) -> tuple[str, str]:
    _, key, line = keys_new(tenant)
    return key, line


def test_keys_new_prints_a_key_and_only_its_hash():
    out, key, line = keys_new("browser")
    assert len(key) > 40
    # The line to paste holds the key's SHA-256 (computed here, not by the code under test)...
    assert line == f'key_sha256 = ["{hashlib.sha256(key.encode()).hexdigest()}"]'
    # ...and the key itself is printed once, before the lines that go into the tenants file.
    assert out.count(key) == 1
    assert key not in out[out.index("[tenants.browser]"):]
    again, _ = new_key("browser")
    assert again != key


def test_demo_model_refuses_a_vision_model_without_its_tokenizer_and_serves_one_with_it(tmp_path):
    require_tokenizers("gemma3", "qwen3")
    out = tmp_path / "vlm"
    # Without --tokenizer, the project's own tokenizer has no Gemma 3 image token: the model it
    # would write (960 embedding rows) is one the gateway refuses to load. An error, nothing written.
    r = subprocess.run([*CLI, "demo-model", str(out), "--arch", "gemma3"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "--tokenizer" in r.stderr and "Gemma 3" in r.stderr, r.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []
    # Another family's tokenizer: refused too, naming the token it lacks.
    r = subprocess.run([*CLI, "demo-model", str(out), "--arch", "gemma3", "--tokenizer", str(TOKENIZERS / "qwen3")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "<image_soft_token>" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []
    r = subprocess.run([*CLI, "demo-model", str(out), "--arch", "gemma3", "--tokenizer", str(TOKENIZERS / "gemma3"),
                        "--vocab-size", "1024"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--vocab-size" in r.stderr, r.stderr
    # With the Gemma 3 tokenizer, the model it writes is served.
    r = subprocess.run([*CLI, "demo-model", str(out), "--arch", "gemma3", "--tokenizer", str(TOKENIZERS / "gemma3")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == str(out), r.stderr
    with live_server(out) as s, s.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    # The text architectures take the project's own tokenizer, as before.
    r = subprocess.run([*CLI, "demo-model", str(tmp_path / "text"), "--arch", "gemma3_text"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_refuses_a_public_host_without_keys():
    r = subprocess.run([*CLI, "serve", "--host", "0.0.0.0", "--model", str(model_path("qwen3"))],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "--allow-unauthenticated" in r.stderr and "--api-key" in r.stderr


def test_refuses_an_invalid_tenants_file(tmp_path):
    bad = tmp_path / "tenants.toml"
    bad.write_text('[tenants.a]\nkey_sha256 = ["not-a-digest"]\n')
    r = subprocess.run([*CLI, "serve", "--tenants", str(bad), "--model", str(model_path("qwen3"))],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "SHA-256" in r.stderr


def test_refuses_a_response_store_it_cannot_use(tmp_path):
    (tmp_path / "file").write_text("")
    for value, said in ((f"sqlite:{tmp_path / 'file' / 'responses.sqlite3'}", "cannot create it"),
                        ("mysql://db/responses", "expected memory, sqlite:PATH")):
        r = subprocess.run([*CLI, "serve", "--responses-store", value, "--model", str(model_path("qwen3"))],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and said in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = subprocess.run([*CLI, "serve", "--responses-store-ttl", "soon"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--responses-store-ttl" in r.stderr


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="SIGHUP does not exist on Windows")
def test_sighup_reloads_tenants_without_dropping_requests(tmp_path):
    old_key, old_line = new_key("app")
    new_key_, new_line = new_key("app")
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f"[tenants.app]\n{old_line}\n")
    port = free_port()
    proc = subprocess.Popen(
        [*CLI, "serve", "--model", str(model_path("qwen3")), "--port", str(port), "--tenants", str(tenants),
         "--log-format", "json"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    # The server's output, read as it comes, so that the test can wait for a log line.
    output: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            output.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}"
    body = {"messages": [{"role": "user", "content": "hi quokka"}], "max_tokens": 2}

    def logged(text: str) -> bool:
        return any(text in line for line in list(output))

    try:
        with httpx.Client(base_url=url, timeout=60) as c:

            def healthy() -> bool:
                assert proc.poll() is None, "the server exited:\n" + "".join(output)
                try:
                    return c.get("/health").status_code == 200
                except httpx.TransportError:
                    return False

            wait_until(healthy, 90, "the server to answer /health", interval=0.2)
            old = {"Authorization": f"Bearer {old_key}"}
            new = {"Authorization": f"Bearer {new_key_}"}
            assert c.post("/v1/chat/completions", json=body, headers=old).status_code == 200
            assert c.post("/v1/chat/completions", json=body, headers=new).status_code == 401
            long_body = {**body, "max_tokens": 300, "stream": True}
            with c.stream("POST", "/v1/chat/completions", json=long_body, headers=old) as held:
                lines = held.iter_lines()
                next(lines)
                tenants.write_text(f"[tenants.app]\n{new_line}\n")
                os.kill(proc.pid, signal.SIGHUP)
                rest = list(lines)  # the request that started before the reload runs to its end
            assert [x for x in rest if x][-1] == "data: [DONE]" and not any('"error"' in x for x in rest)
            wait_until(lambda: c.post("/v1/chat/completions", json=body, headers=new).status_code == 200,
                       10, "the reload to accept the new key", interval=0.1)
            assert c.post("/v1/chat/completions", json=body, headers=old).status_code == 401
            # A broken file on reload keeps the tenants in use.
            tenants.write_text("this is not toml [")
            os.kill(proc.pid, signal.SIGHUP)
            wait_until(lambda: logged("tenants file not reloaded"), 10, "the server to log the failed reload")
            assert c.post("/v1/chat/completions", json=body, headers=new).status_code == 200
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(10)
    out = "".join(output)
    assert "tenants file not reloaded" in out
    assert old_key not in out and new_key_ not in out
    # --log-format json: every line is a JSON object; each request has one line with its figures.
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    requests = [r for r in records if r["logger"] == "mlx_gateway.requests"]
    streamed = next(r for r in requests if r.get("stream"))
    assert streamed["tenant"] == "app" and streamed["status"] == 200 and streamed["completion_tokens"] > 0
    for field in ("prompt_tokens", "cached_tokens", "queue_seconds", "ttft_seconds", "total_seconds",
                  "request_id", "model", "finish_reason"):
        assert field in streamed, field
    assert any(r["status"] == 401 and "tenant" not in r for r in requests)  # refused requests are logged too
    assert "quokka" not in json.dumps(requests)  # no prompt text without --log-prompts


def test_tune_measures_each_setting_within_its_budget_and_recommends_flags(tmp_path):
    """``mlx-gateway tune`` on a tiny model with a small workload: the base setting runs,
    the next one is skipped once the time budget is spent, the table and the recommended
    flags are printed, the progress bar is drawn, and the files are written (the plot where
    matplotlib is installed)."""
    import importlib.util

    out = subprocess.run([*CLI, "tune", "--model", str(model_path("qwen3")), "--burst", "2", "--streams", "1",
                          "--agents", "1", "--agent-tokens", "200", "--values", "prompt-concurrency=1",
                          "--values", "prefill-step-size=", "--values", "prefill-budget=", "--budget", "0.01",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 2
    assert rows[0].startswith("| 8 | 2048 | 0.2 | ") and "skipped" not in rows[0]
    assert rows[1].startswith("| 1 | 2048 | 0.2 | skipped: time budget")
    assert "recommended: --prompt-concurrency 8 --prefill-step-size 2048 --prefill-budget 0.2" in out.stdout
    assert "[############------------] 1/2 settings" in out.stderr
    saved = json.loads((tmp_path / "tune.json").read_text())
    assert saved[0]["figures"]["failed"] == 0 and saved[0]["figures"]["tok_s"] > 0 and saved[1]["skipped"]
    assert "recommended:" in (tmp_path / "tune.md").read_text()
    assert (tmp_path / "tune.png").exists() == (importlib.util.find_spec("matplotlib") is not None)


def test_tune_refuses_an_unknown_flag_or_model():
    out = subprocess.run([*CLI, "tune", "--values", "decode-budget=1"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "unknown flag 'decode-budget'" in out.stderr
    out = subprocess.run([*CLI, "tune", "--model", "/no/such/model"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "cannot use the model '/no/such/model'" in out.stderr
