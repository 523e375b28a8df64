"""Shared fixtures: tiny random-weight models of real architectures, built once per run.

Models are written by :func:`gateway.models.demo_model.build_model_dir` and loaded through the
real ``mlx_lm.load`` path. Real tokenizers come from ``../shared/fixtures/tokenizers``
(override with ``MLX_GATEWAY_TOKENIZERS``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway.models.demo_model import build_model_dir

ROOT = Path(__file__).resolve().parents[1]
TOKENIZERS = Path(
    os.environ.get("MLX_GATEWAY_TOKENIZERS", ROOT.parent / "shared" / "fixtures" / "tokenizers")
)

# Architecture -> (tokenizer fixture directory or None for the project's own BPE, vocab_size).
ARCH_TOKENIZERS = {
    "qwen3": (None, None),
    "llama": ("llama3", 128256),
    "qwen3_5": ("qwen3", 151936),
    "gemma3_text": ("gemma3", 262208),
    "mamba2": ("qwen3", 151936),
    "nemotron_h": ("qwen3", 151936),
}

_MODEL_CACHE = Path(os.environ.get("MLX_GATEWAY_TEST_MODELS", ROOT / ".test-models"))


def model_path(arch: str, tokenizer: str | None = "default") -> Path:
    """Build (once) and return the directory of the tiny ``arch`` model.

    ``tokenizer="default"`` uses :data:`ARCH_TOKENIZERS`; ``"qwen3"`` etc. picks a
    fixture tokenizer explicitly (with its family's vocabulary size).
    """
    if tokenizer == "default":
        tok_name, vocab = ARCH_TOKENIZERS[arch]
    else:
        tok_name = tokenizer
        vocab = {"qwen3": 151936, "llama3": 128256, "gemma3": 262208, None: None}[tokenizer]
    tok_dir = TOKENIZERS / tok_name if tok_name else None
    return build_model_dir(
        _MODEL_CACHE / f"{arch}-{tok_name or 'own'}", arch, tokenizer_dir=tok_dir, vocab_size=vocab
    )


@pytest.fixture(scope="session")
def tokenizers_dir() -> Path:
    return TOKENIZERS


# ---------------------------------------------------------------------- live servers
import contextlib
import socket
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """A real gateway (uvicorn on a loopback port, in a thread of the test process).

    ``state`` is the server's :class:`gateway.http.app.ServerState`, so tests can read the
    engine's own counters; ``url`` is the base URL.
    """

    def __init__(self, state, server, thread, url):
        self.state, self.server, self.thread, self.url = state, server, thread, url

    @property
    def engine(self):
        return self.state.engine

    def client(self, **kw) -> httpx.Client:
        kw.setdefault("timeout", 120)
        return httpx.Client(base_url=self.url, **kw)

    def openai(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@contextlib.contextmanager
def live_server(model_dir, **config):
    """Start a gateway serving ``model_dir`` with ServeConfig overrides; stop it on exit."""
    import uvicorn

    from gateway.http.app import create_app
    from gateway.config import ServeConfig
    from gateway.server import build_state, load_into

    cfg = ServeConfig(model=str(model_dir), port=free_port(), **config)
    state = build_state(cfg, "test-model")
    load_into(state, str(model_dir))
    assert state.engine is not None, state.load_error
    app = create_app(state)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=cfg.port, log_level="warning",
                                           h11_max_incomplete_event_size=cfg.max_header_bytes))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.01)
    try:
        yield LiveServer(state, server, thread, f"http://127.0.0.1:{cfg.port}")
    finally:
        server.should_exit = True
        thread.join(10)
        state.engine.stop()
