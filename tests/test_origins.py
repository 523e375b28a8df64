"""Keys bound to browser origins: a tenant's ``origins`` list binds its keys to those
``Origin`` values (requests without one only with ``allow_no_origin``); CORS answers the
tenants' origins, ``--allowed-origins`` or ``OLLAMA_ORIGINS`` as Ollama's patterns, and
Ollama's local origins on Ollama's API; and in a real headless Chromium a page from an
origin that is not allowed cannot read an answer, while a page from an allowed one streams
a chat completion, and an unpacked extension (``tests/fixtures/browser_extension``) calls
Ollama's API and the OpenAI API from its ``chrome-extension://`` origin."""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading

import httpx
import pytest

from conftest import ROOT, TEST_MAX_TOKENS_FLAGS, free_port, live_server, model_path, sample, wait_until
from gateway.http.origins import configured_origins, split_origins
from gateway.tenancy.tenants import TenantsFileError, hash_key, load_tenants

PAGE = """<!doctype html><html><body><pre id="out">pending</pre><script>
(async () => {
  const out = document.getElementById("out");
  try {
    const r = await fetch("GATEWAY/v1/chat/completions", {method: "POST",
      headers: {"Authorization": "Bearer KEY", "Content-Type": "application/json"},
      body: JSON.stringify({model: "test-model", max_tokens: 8, temperature: 0, stream: true,
                            messages: [{role: "user", content: "Say hello"}]})});
    out.textContent = "status " + r.status;
    const text = await r.text();  // the whole stream, as it comes
    const events = text.split("\\n").filter(l => l.startsWith("data: ")).length;
    out.textContent = "STATUS " + r.status + " EVENTS " + events + " DONE " + text.includes("data: [DONE]");
  } catch (e) {
    out.textContent = "ERROR " + e;
  }
})();
</script></body></html>"""


def tenants_file(path, allowed: str) -> str:
    path.write_text(f"""
[tenants.ext]
key_sha256 = ["{hash_key('mgw-ext')}"]
origins = ["{allowed}", "chrome-extension://abcdefghijklmnopabcdefghijklmnop"]

[tenants.tool]
key_sha256 = ["{hash_key('mgw-tool')}"]
origins = ["https://app.example"]
allow_no_origin = true

[tenants.agent]
key_sha256 = ["{hash_key('mgw-agent')}"]
""")
    return str(path)


def chat(c, key: str, origin=None):
    headers = {"Authorization": f"Bearer {key}", **({"Origin": origin} if origin else {})}
    return c.post("/v1/chat/completions", headers=headers, json={
        "model": "test-model", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})


def test_keys_bound_to_origins(tmp_path):
    ext_origin = "chrome-extension://abcdefghijklmnopabcdefghijklmnop"
    with live_server(model_path("qwen3"), tenants=tenants_file(tmp_path / "t.toml", "http://127.0.0.1:1")) as s, \
            s.client() as c:
        assert chat(c, "mgw-ext", ext_origin).status_code == 200
        for origin in ("https://evil.example", None):  # another origin; no origin without allow_no_origin
            r = chat(c, "mgw-ext", origin)
            assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", r.text
        r = c.post("/v1/messages", headers={"x-api-key": "mgw-ext", "Origin": "https://evil.example"},
                   json={"model": "test-model", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", r.text
        assert chat(c, "mgw-tool").status_code == 200  # no Origin, allowed
        assert chat(c, "mgw-tool", "https://app.example").status_code == 200
        assert chat(c, "mgw-tool", ext_origin).status_code == 403  # another tenant's origin
        assert chat(c, "mgw-agent", "https://anywhere.example").status_code == 200  # not bound
        assert sample(s.registry, "mlx_gateway_origin_refused_total", tenant="ext") == 3
        assert sample(s.registry, "mlx_gateway_origin_refused_total", tenant="tool") == 1
        # CORS answers every tenant's origins, and only those.
        pre = c.options("/v1/chat/completions", headers={"Origin": ext_origin, "Access-Control-Request-Method": "POST",
                                                         "Access-Control-Request-Headers": "authorization"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ext_origin
        bad = c.options("/v1/chat/completions", headers={"Origin": "https://evil.example",
                                                         "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in bad.headers


# ---------------------------------------------------------------------- a real browser


def chromium() -> str:
    """Headless Chromium from PATH (``.ci/run`` installs Debian's ``chromium`` package, or
    Homebrew's on macOS); skips the test, saying why, when there is none."""
    for name in ("chromium", "chromium-browser", "google-chrome", "Chromium"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.skip("headless Chromium is not installed (Debian: apt-get install chromium; "
                "macOS: brew install --cask chromium)")


@contextlib.contextmanager
def page_server(directory, port: int):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(directory))
    handler.log_message = lambda *a: None
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.shutdown()
        srv.server_close()


def run_page(browser: str, url: str, profile) -> str:
    """Load ``url`` in headless Chromium and return what the page wrote (without this
    process's ``LD_PRELOAD``: Chromium's GPU process refuses to start under OpenBLAS)."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    out = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", "--virtual-time-budget=20000", "--dump-dom", url],
        capture_output=True, text=True, timeout=120, env=env).stdout
    m = re.search(r'<pre id="out">(.*?)</pre>', out, re.S)
    assert m, out[-2000:]
    return m.group(1)


def test_a_browser_page_reads_answers_only_from_an_allowed_origin(tmp_path):
    browser = chromium()
    allowed_port, other_port = free_port(), free_port()
    allowed = f"http://127.0.0.1:{allowed_port}"
    with live_server(model_path("qwen3"), tenants=tenants_file(tmp_path / "t.toml", allowed),
                     allowed_hosts=["*"]) as s:
        (tmp_path / "page.html").write_text(PAGE.replace("GATEWAY", s.url).replace("KEY", "mgw-ext"))
        with page_server(tmp_path, allowed_port) as ok_site, page_server(tmp_path, other_port) as other_site:
            good = run_page(browser, ok_site + "/page.html", tmp_path / "profile-ok")
            bad = run_page(browser, other_site + "/page.html", tmp_path / "profile-other")
    assert good.startswith("STATUS 200 EVENTS") and good.endswith("DONE true"), good
    assert int(good.split()[3]) >= 3, good  # the role chunk, tokens, the finish chunk
    assert bad.startswith("ERROR TypeError"), bad  # the browser refused to let it read anything


# ---------------------------------------------------------------------- Ollama's origins

EXTENSION = ROOT / "tests" / "fixtures" / "browser_extension"


def extension_id(directory) -> str:
    """Chromium's id of the unpacked extension in ``directory``, from its manifest's ``key``:
    the first 32 hex digits of the SHA-256 of the public key (DER), 0-f written a-p."""
    key = base64.b64decode(json.loads((directory / "manifest.json").read_text())["key"])
    return "".join(chr(ord("a") + int(c, 16)) for c in hashlib.sha256(key).hexdigest()[:32])


EXT_ORIGIN = f"chrome-extension://{extension_id(EXTENSION)}"
OLLAMA_LOCAL = ("http://localhost:3000", "http://127.0.0.1", "https://0.0.0.0:8443", "app://obsidian.md",
                "tauri://localhost", "vscode-webview://abc123", "vscode-file://vscode-app")


def cors_allows(c, path: str, origin: str) -> bool:
    """Whether the gateway's preflight for a JSON POST to ``path`` from ``origin`` lets it through."""
    r = c.options(path, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                 "Access-Control-Request-Headers": "content-type,authorization"})
    return r.status_code == 200 and r.headers.get("access-control-allow-origin") == origin


def test_origins_take_ollamas_patterns_and_ollama_origins(tmp_path):
    assert split_origins(" chrome-extension://* , http://localhost:3000/ ") == ["chrome-extension://*",
                                                                                "http://localhost:3000"]
    with pytest.raises(ValueError, match="one '\\*'"):
        split_origins("http://*.example:*")
    # OLLAMA_ORIGINS (quotes stripped, as Ollama does) when --allowed-origins is not given; the flag wins.
    env = {"OLLAMA_ORIGINS": "'chrome-extension://*,moz-extension://*'"}
    assert configured_origins(None, env) == ["chrome-extension://*", "moz-extension://*"]
    assert configured_origins(["https://app.example"], env) == ["https://app.example"]
    assert configured_origins(None, {}) == []
    with pytest.raises(ValueError, match="OLLAMA_ORIGINS"):
        configured_origins(None, {"OLLAMA_ORIGINS": "a*b*"})
    # A tenant's origins take the same patterns.
    f = tmp_path / "t.toml"
    f.write_text(f'[tenants.ext]\nkey_sha256 = ["{hash_key("k")}"]\norigins = ["chrome-extension://*"]\n')
    ext, _ = load_tenants(f).authenticate("k")
    assert ext.origin_allowed(EXT_ORIGIN) and not ext.origin_allowed("https://evil.example")
    f.write_text(f'[tenants.ext]\nkey_sha256 = ["{hash_key("k")}"]\norigins = ["a*b*"]\n')
    with pytest.raises(TenantsFileError, match="one '\\*'"):
        load_tenants(f)
    r = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--allowed-origins", "http://*.x:*"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--allowed-origins" in r.stderr, r.stderr


def test_ollamas_local_origins_on_its_api_only_and_patterns_on_every_api():
    with live_server(model_path("qwen3")) as s, s.client() as c:
        for origin in OLLAMA_LOCAL:  # Ollama's defaults: its API answers local pages and apps...
            assert cors_allows(c, "/api/chat", origin) and cors_allows(c, "/", origin), origin
            assert not cors_allows(c, "/v1/chat/completions", origin), origin  # ...the other APIs do not
        for origin in (EXT_ORIGIN, "https://evil.example", "http://localhost.evil.example", "null"):
            assert not cors_allows(c, "/api/chat", origin), origin
        # A GET needs no preflight: the answer carries the header, or not.
        assert c.get("/api/tags", headers={"Origin": "http://localhost:3000"}).headers.get(
            "access-control-allow-origin") == "http://localhost:3000"
        assert "access-control-allow-origin" not in c.get("/v1/models", headers={"Origin": "http://localhost:3000"}).headers
    with live_server(model_path("qwen3"), allowed_origins=["chrome-extension://*"]) as s, s.client() as c:
        for path in ("/api/chat", "/api/tags", "/v1/chat/completions", "/v1/messages", "/v1/responses"):
            assert cors_allows(c, path, EXT_ORIGIN), path
        assert not cors_allows(c, "/v1/chat/completions", "https://evil.example")
        assert not cors_allows(c, "/v1/chat/completions", "moz-extension://abc")


def test_keys_bound_to_origin_patterns_hold_on_every_api(tmp_path):
    f = tmp_path / "t.toml"
    f.write_text(f'[tenants.ext]\nkey_sha256 = ["{hash_key("mgw-ext")}"]\norigins = ["chrome-extension://*"]\n')
    ok = {"Authorization": "Bearer mgw-ext", "Origin": EXT_ORIGIN}
    # Ollama's API lets a local page through CORS, but not through the key's binding.
    local = {"Authorization": "Bearer mgw-ext", "Origin": "http://localhost:3000"}
    with live_server(model_path("qwen3"), tenants=str(f)) as s, s.client() as c:
        assert chat(c, "mgw-ext", EXT_ORIGIN).status_code == 200
        assert chat(c, "mgw-ext", "http://localhost:3000").status_code == 403
        assert cors_allows(c, "/v1/chat/completions", EXT_ORIGIN)  # CORS answers the tenant's pattern
        ask = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "stream": False,
               "options": {"num_predict": 2}}
        assert c.get("/api/tags", headers=ok).status_code == 200
        r = c.get("/api/tags", headers=local)
        assert r.status_code == 403 and "error" in r.json(), r.text
        r = c.post("/api/chat", headers=local, json=ask)
        assert r.status_code == 403 and "error" in r.json(), r.text
        r = c.post("/api/chat", headers=ok, json=ask)
        assert r.status_code == 200 and r.json()["done"] is True, r.text
        assert sample(s.registry, "mlx_gateway_origin_refused_total", tenant="ext") == 3


def run_extension_page(browser: str, url: str, profile, extension=None, resolve: str | None = None) -> dict:
    """Load ``url`` (a page running ``page.js`` of the test extension) in headless Chromium, with
    the unpacked ``extension`` loaded and ``resolve`` mapped to 127.0.0.1, and return what the
    page read (its ``<pre id="out">DONE {...}</pre>``)."""
    import html

    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # (see run_page)
    cmd = [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}"]
    if extension is not None:
        cmd += [f"--load-extension={extension}", f"--disable-extensions-except={extension}"]
    if resolve is not None:
        cmd.append(f"--host-resolver-rules=MAP {resolve} 127.0.0.1")
    out = subprocess.run([*cmd, "--virtual-time-budget=30000", "--dump-dom", url], capture_output=True, text=True,
                         timeout=120, env=env).stdout
    m = re.search(r'<pre id="out">DONE (.*?)</pre>', out, re.S)
    assert m, out[-2000:]
    return json.loads(html.unescape(m.group(1)))


def assert_read_everything(result: dict, origin: str) -> None:
    """The page at ``origin`` read the answers of Ollama's API and of the OpenAI API."""
    assert result["origin"] == origin
    v1 = result["v1"]
    assert v1["status"] == 200 and v1["body"]["choices"][0]["message"]["role"] == "assistant", v1
    # The browser let it read Ollama's API's answers (what the routes answer is checked below).
    assert "error" not in result["tags"] and "error" not in result["chat"], result
    tags = result["tags"]
    assert tags["status"] == 200 and "test-model" in [m["name"] for m in tags["body"]["models"]], tags
    chat_ = result["chat"]
    lines = chat_.get("lines", [])
    assert chat_["status"] == 200 and len(lines) >= 2, chat_  # streamed: pieces, then the final object
    assert all(not line["done"] for line in lines[:-1]) and lines[-1]["done"] is True, lines
    assert all(line["message"]["role"] == "assistant" for line in lines), lines
    assert "".join(line["message"]["content"] for line in lines), lines
    assert lines[-1]["eval_count"] >= 1 and lines[-1]["done_reason"] in ("stop", "length"), lines[-1]


def assert_refused(result: dict, *names: str) -> None:
    for name in names:
        assert result[name].get("error", "").startswith("TypeError"), (name, result)


def test_a_browser_extension_uses_ollamas_api_and_the_openai_api_from_its_origin(tmp_path):
    browser = chromium()
    page = f"{EXT_ORIGIN}/page.html?gateway="
    # --allowed-origins with Ollama's pattern for every extension.
    with live_server(model_path("qwen3"), allowed_origins=["chrome-extension://*"]) as s:
        assert_read_everything(run_extension_page(browser, page + s.url, tmp_path / "p1", EXTENSION), EXT_ORIGIN)
        with page_server(EXTENSION, free_port()) as site:
            # The same script from a web page on another origin: refused everywhere.
            other = site.replace("127.0.0.1", "page.example")
            got = run_extension_page(browser, f"{other}/page.html?gateway={s.url}", tmp_path / "p2",
                                     resolve="page.example")
            assert got["origin"] == other
            assert_refused(got, "tags", "chat", "v1")
            # From a local page (Ollama's defaults): Ollama's API answers it, the OpenAI API does not.
            local = site.replace("127.0.0.1", "localhost")
            got = run_extension_page(browser, f"{local}/page.html?gateway={s.url}", tmp_path / "p3")
            assert got["origin"] == local and "error" not in got["tags"] and "error" not in got["chat"], got
            assert_refused(got, "v1")
    # OLLAMA_ORIGINS, as the extensions' setup notes tell their users to set it, read by `mlx-gateway serve`.
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--model", str(model_path("qwen3")),
                             "--served-model-name", "test-model", "--port", str(port), *TEST_MAX_TOKENS_FLAGS],
                            env={**os.environ, "OLLAMA_ORIGINS": "chrome-extension://*"}, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        def ready() -> bool:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False
        wait_until(ready, 120, "mlx-gateway serve to load its model", interval=0.2)
        got = run_extension_page(browser, page + f"http://127.0.0.1:{port}", tmp_path / "p4", EXTENSION)
        assert_read_everything(got, EXT_ORIGIN)
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    # Neither: the extension (it has no host_permissions) is held to CORS like a web page.
    with live_server(model_path("qwen3")) as s:
        assert_refused(run_extension_page(browser, page + s.url, tmp_path / "p5", EXTENSION), "tags", "chat", "v1")
