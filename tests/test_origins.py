"""Keys bound to browser origins: a tenant's ``origins`` list binds its keys to those
``Origin`` values (requests without one only with ``allow_no_origin``); CORS answers the
tenants' origins; and in a real headless Chromium a page from an origin that is not
allowed cannot read an answer, while a page from an allowed one streams a chat completion."""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import re
import shutil
import subprocess
import threading

import pytest

from conftest import free_port, live_server, model_path, sample
from gateway.tenancy.tenants import hash_key

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
