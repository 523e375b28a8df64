"""Shared fixtures: tiny random-weight models of real architectures, built once per run.

Models are written by :func:`gateway.models.demo_model.build_model_dir` and loaded through the
real ``mlx_lm.load`` path. Real tokenizers come from ``tests/fixtures/tokenizers`` (origin and
licences in its ``SOURCES.md``; override with ``MLX_GATEWAY_TOKENIZERS``). Their big files are
stored xz-compressed; :data:`TOKENIZERS` is a decompressed copy made once under
``.test-models/``, so tests can hand ``TOKENIZERS / "qwen3"`` to any tokenizer loader.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import lzma
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, TypeVar

import httpx
import pytest

from gateway.models.demo_model import build_model_dir, copy_tokenizer_files
from scheduler.request import DoneEvent, ErrorEvent, TokenEvent

ROOT = Path(__file__).resolve().parents[1]

# The gateway's data directory (the default response store's SQLite file) is a temporary
# one for the whole run, inherited by gateway subprocesses: tests never write into the
# user's own data directory, and a run starts from an empty store.
_DATA_DIR = tempfile.TemporaryDirectory(prefix="mlx-gateway-test-data-")
os.environ["MLX_GATEWAY_DATA_DIR"] = _DATA_DIR.name
_MODEL_CACHE = Path(os.environ.get("MLX_GATEWAY_TEST_MODELS", ROOT / ".test-models"))

# ---------------------------------------------------------------------- tokenizers
FIXTURE_TOKENIZERS = Path(__file__).resolve().parent / "fixtures" / "tokenizers"
TOKENIZER_SOURCE = Path(os.environ.get("MLX_GATEWAY_TOKENIZERS") or FIXTURE_TOKENIZERS)
TOKENIZER_FAMILIES = ("qwen3", "llama3", "gemma3")
_NEEDED = ("tokenizer.json", "tokenizer_config.json")


def _materialize_tokenizers(src: Path, cache: Path) -> tuple[Path, dict[str, str]]:
    """Decompressed copies of the tokenizer families in ``src``, under ``cache``.

    Returns the directory holding one subdirectory per family found, and the families that
    are missing (name -> why). The copy's name carries a hash of the source files, so a
    changed fixture gets a fresh copy (and the models built on it are rebuilt), and test
    runs in parallel never rewrite a directory another one reads.
    """
    missing: dict[str, str] = {}
    files: dict[str, list[Path]] = {}
    digest = hashlib.sha256()
    for name in TOKENIZER_FAMILIES:
        d = src / name
        absent = [f for f in _NEEDED if not (d / f).is_file() and not (d / f"{f}.xz").is_file()]
        if not d.is_dir():
            missing[name] = f"no directory {d}"
        elif absent:
            missing[name] = f"{d} has no {' or '.join(absent)} (nor its .xz)"
        else:
            files[name] = sorted(f for f in d.iterdir() if f.is_file())
            for f in files[name]:
                digest.update(f"{name}/{f.name}\0".encode())
                digest.update(f.read_bytes())
    out = cache / f"tokenizers-{digest.hexdigest()[:16]}"
    if files and not (out / ".complete").exists():
        tmp = cache / f".{out.name}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        for name in files:
            (tmp / name).mkdir(parents=True)
            try:
                copy_tokenizer_files(src / name, tmp / name)
            except (OSError, lzma.LZMAError) as e:
                missing[name] = f"{src / name} could not be read: {e}"
                shutil.rmtree(tmp / name)
        (tmp / ".complete").touch()
        try:
            os.rename(tmp, out)
        except OSError:  # another test run made it first
            shutil.rmtree(tmp, ignore_errors=True)
            if not (out / ".complete").exists():
                raise
    for name in files:
        if name not in missing and not all((out / name / f).is_file() for f in _NEEDED):
            missing[name] = f"{src / name} could not be copied and decompressed into {out / name}"
    return out, missing


TOKENIZERS, MISSING_TOKENIZERS = _materialize_tokenizers(TOKENIZER_SOURCE, _MODEL_CACHE)


def require_tokenizers(*names: str) -> None:
    """Skip the calling test, saying how to get them, unless the fixture tokenizers
    ``names`` are available."""
    gone = {n: MISSING_TOKENIZERS[n] for n in names if n in MISSING_TOKENIZERS}
    if gone:
        pytest.skip(
            "tokenizer fixture(s) missing: " + "; ".join(f"{n}: {why}" for n, why in gone.items())
            + ". They ship with the repository in tests/fixtures/tokenizers/ (see SOURCES.md there):"
            " restore them with `git checkout -- tests/fixtures/tokenizers`, or set"
            " MLX_GATEWAY_TOKENIZERS to a directory holding <family>/tokenizer.json(.xz) and"
            " tokenizer_config.json(.xz)."
        )


# Architecture -> (tokenizer fixture directory or None for the project's own BPE, vocab_size).
ARCH_TOKENIZERS = {
    "qwen3": (None, None),
    "llama": ("llama3", 128256),
    "qwen3_5": ("qwen3", 151936),
    "gemma3_text": ("gemma3", 262208),
    "mamba2": ("qwen3", 151936),
    "nemotron_h": ("qwen3", 151936),
    "gemma3": ("gemma3", 262208),  # a Gemma 3 vision-language model (mlx-vlm)
    "qwen2_5_vl": ("qwen3", 151936),  # Qwen vision-language models (mlx-vlm, M-RoPE)
    "qwen3_vl": ("qwen3", 151936),
    "qwen3_5_vl": ("qwen3", 151936),
    "qwen3_embedding": ("qwen3", 151936),  # a Qwen3-Embedding model (mlx-embeddings)
}


def model_path(arch: str, tokenizer: str | None = "default") -> Path:
    """Build (once) and return the directory of the tiny ``arch`` model.

    ``tokenizer="default"`` uses :data:`ARCH_TOKENIZERS`; ``"qwen3"`` etc. picks a
    fixture tokenizer explicitly (with its family's vocabulary size). Skips the test if
    that fixture tokenizer is missing.
    """
    if tokenizer == "default":
        tok_name, vocab = ARCH_TOKENIZERS[arch]
    else:
        tok_name = tokenizer
        vocab = {"qwen3": 151936, "llama3": 128256, "gemma3": 262208, None: None}[tokenizer]
    if tok_name:
        require_tokenizers(tok_name)
    tok_dir = TOKENIZERS / tok_name if tok_name else None
    return build_model_dir(
        _MODEL_CACHE / f"{arch}-{tok_name or 'own'}", arch, tokenizer_dir=tok_dir, vocab_size=vocab
    )


def load_model(path, adapter_path=None, lazy: bool = False):
    """The model of ``mlx_lm.load(path, adapter_path=adapter_path, lazy=lazy)``, built by the
    same ``load_model`` (and ``load_adapters``) calls, without the tokenizer that load also
    reads: a fixture tokenizer takes seconds to parse (Gemma 3's, 262k tokens, the most),
    and a test that wants only the weights would throw it away."""
    from mlx_lm.utils import load_adapters
    from mlx_lm.utils import load_model as _load_model

    model, _ = _load_model(Path(path), lazy)
    if adapter_path is not None:
        model = load_adapters(model, str(adapter_path))
        model.eval()
    return model


def load_tokenizer(path):
    """The tokenizer ``mlx_lm.load(path)`` loads (the eos ids of the model's config, as that
    load passes them; a tokenizer directory without a config.json gets none), loaded once
    per run and shared: callers only read it (ids, encode, templates), never its streaming
    detokenizer, which holds one decode's state."""
    return _shared_tokenizer(str(Path(path).resolve()))


@functools.lru_cache(maxsize=4)  # a fixture tokenizer takes 40 to 350 MB (Gemma 3's)
def _shared_tokenizer(path: str):
    from mlx_lm.utils import load_config
    from mlx_lm.utils import load_tokenizer as _load_tokenizer

    d = Path(path)
    eos = load_config(d).get("eos_token_id", None) if (d / "config.json").is_file() else None
    # A gateway of this run that served the model keeps the tokenizer it loaded from these
    # files (gateway.models.load_memo, imported once a gateway ran): the same mlx_lm load,
    # taken when its eos ids are these (parsing it again takes seconds, Gemma 3's about 5).
    memo, want = sys.modules.get("gateway.models.load_memo"), {eos} if isinstance(eos, int) else set(eos or ())
    kept = memo.kept_tokenizer(d) if memo is not None and want else None
    if kept is not None and set(kept.eos_token_ids) == want:
        return kept
    return _load_tokenizer(d, eos_token_ids=eos)


def load(path, adapter_path=None):
    """``mlx_lm.load(path, adapter_path=adapter_path)``: a freshly loaded model (engines
    and adapters change theirs) and the shared :func:`load_tokenizer`."""
    return load_model(path, adapter_path), load_tokenizer(path)


@pytest.fixture(scope="session")
def tokenizers_dir() -> Path:
    """:data:`TOKENIZERS`; skips the test unless every fixture tokenizer is there."""
    require_tokenizers(*TOKENIZER_FAMILIES)
    return TOKENIZERS


@pytest.fixture(scope="module", autouse=True)
def _tokenizers_of_module(request):
    """A module that reads ``TOKENIZERS`` directly (``from conftest import TOKENIZERS``)
    is skipped, with how to get them, when a fixture tokenizer is missing."""
    if MISSING_TOKENIZERS and request.module is not None and "TOKENIZERS" in vars(request.module):
        require_tokenizers(*TOKENIZER_FAMILIES)


# ---------------------------------------------------------------------- waiting
T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.01) -> T:
    """Poll ``predicate`` until it returns a truthy value, and return that value.

    Raises AssertionError naming ``what`` (what the test waits for) once ``timeout`` seconds
    have passed. ``predicate`` may itself raise to stop waiting early, e.g. when the process
    it waits on has exited.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


# ---------------------------------------------------------------------- metrics


def sample(registry, name: str, **labels) -> float:
    """The sum of the samples ``name`` whose labels include ``labels``, in a prometheus
    registry (or in ``/metrics`` text); 0 when there is none. A model's engine and cache
    series carry a ``model`` label, which a test of one model need not name."""
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(registry) if isinstance(registry, str) else registry.collect()
    return sum(s.value for fam in families for s in fam.samples
               if s.name == name and labels.items() <= s.labels.items())


# ---------------------------------------------------------------------- live servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """A real gateway (uvicorn on a loopback port, in a thread of the test process).

    ``gateway`` is the server's :class:`gateway.server.Gateway`, so tests can read the
    engines' own counters; ``model`` is the first model's handle (loaded at start);
    ``url`` is the base URL.
    """

    def __init__(self, gateway, server, thread, url):
        self.gateway, self.server, self.thread, self.url = gateway, server, thread, url
        # The handles of the models loaded at start, still readable once the server stopped.
        self._handles = {s.name: s.handle for s in gateway.models.slots if s.handle is not None}

    @property
    def front(self):
        return self.gateway.front

    @property
    def app(self):
        return self.gateway.app

    @property
    def registry(self):
        return self.gateway.registry

    @property
    def model(self):
        """The first served model's handle (it must be loaded)."""
        return self.handle(self.gateway.models.slots[0].name)

    def handle(self, name: str):
        """The handle of the loaded model ``name`` (or, once the server stopped, the one it
        had at start)."""
        slot = self.gateway.models.find(name)
        assert slot is not None, f"no model {name}"
        handle = slot.handle or self._handles.get(slot.name)
        assert handle is not None, f"model {name} is not loaded"
        return handle

    @property
    def engine(self):
        return self.model.engine

    @property
    def tokenizer(self):
        return self.model.tokenizer

    def client(self, **kw) -> httpx.Client:
        kw.setdefault("timeout", 120)
        return httpx.Client(base_url=self.url, **kw)

    def openai(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)


# ``max_tokens`` of a test gateway's requests that give none. ``serve`` itself has no such
# default (an answer runs until the model stops or the context ends), and a random-weight
# model rarely emits its end token: it would write to the end of its 32768-token context.
TEST_MAX_TOKENS = 512
# The same for ``mlx-gateway serve`` subprocesses.
TEST_MAX_TOKENS_FLAGS = ["--max-tokens", str(TEST_MAX_TOKENS)]


def start_gateway(cfg, specs=None, tenants=None, wait: bool = True,
                  default_max_tokens: int | None = TEST_MAX_TOKENS):
    """Build and start a gateway for ``cfg`` (its models loading in the background); with
    ``wait``, wait until the models to load at start are ready (AssertionError if one failed).

    ``default_max_tokens``: the ``max_tokens`` of ``cfg`` and of each of ``specs`` that has
    none (:data:`TEST_MAX_TOKENS`); None keeps the gateway's own (until the context ends)."""
    from dataclasses import replace

    from gateway.server import build_gateway

    if default_max_tokens is not None:
        n = default_max_tokens
        cfg = cfg if cfg.max_tokens is not None else replace(cfg, max_tokens=n)
        specs = None if specs is None else [s if s.max_tokens is not None else replace(s, max_tokens=n)
                                            for s in specs]
    gw = build_gateway(cfg, tenants, specs)
    gw.start()
    if wait:
        status = wait_until(lambda: gw.models.startup()[0] != "loading" and gw.models.startup(), 120,
                            "the models to load")
        assert status[0] == "ok", status
    return gw


@contextlib.contextmanager
def serving(gw, port: int, max_header_bytes: int = 16 << 10):
    """Serve the gateway ``gw`` with uvicorn on ``port`` (a thread of the test process)
    until the block ends; then stop it."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(gw.app, host="127.0.0.1", port=port, log_level="warning",
                                           h11_max_incomplete_event_size=max_header_bytes))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()

    def started() -> bool:
        if not thread.is_alive():
            raise RuntimeError("the server thread exited before it started serving")
        return server.started

    try:
        wait_until(started, 30, "the server to start")
        yield LiveServer(gw, server, thread, f"http://127.0.0.1:{port}")
    finally:
        server.should_exit = True
        thread.join(10)
        gw.stop()


@contextlib.contextmanager
def live_server(model_dir, specs=None, default_max_tokens: int | None = TEST_MAX_TOKENS, **config):
    """Start a gateway serving ``model_dir`` as ``test-model`` (or the models ``specs``)
    with ServeConfig overrides; stop it on exit. ``default_max_tokens``: as in
    :func:`start_gateway` (a ``max_tokens`` override wins)."""
    from dataclasses import replace

    from gateway.config import ServeConfig
    from gateway.models.spec import model_specs

    cfg = ServeConfig(model=str(model_dir), port=free_port(), **config)
    if specs is None:
        specs = [replace(s, name="test-model") for s in model_specs(cfg)]
    gw = start_gateway(cfg, specs, default_max_tokens=default_max_tokens)
    with serving(gw, cfg.port, cfg.max_header_bytes) as srv:
        yield srv


async def stream_completion_logprobs(client: httpx.AsyncClient, prompt: str, max_tokens: int,
                                    bias: dict | None = None, started=None) -> list[tuple[int, float]]:
    """(token, logprob) pairs of a streamed greedy ``/v1/completions`` answer; sets the
    ``started`` event (if any) at its first token."""
    body = {"model": "test-model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "logprobs": 0}
    if bias:
        body["logit_bias"] = bias
    out = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                lp = chunk["choices"][0]["logprobs"] if chunk["choices"] else None
                if lp:
                    out.extend(zip(lp["tokens"], lp["token_logprobs"]))
                    if started is not None:
                        started.set()
    return out


class CountingModel:
    """A real mlx-lm model that counts its forward calls (:attr:`calls`); everything
    else is the model's own."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def prefilled(model, tokens: list[int]) -> list:
    """A fresh prompt cache (one cache per layer) holding ``tokens``, evaluated."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def assert_same_tokens(got: list, want: list, what: str) -> None:
    """Two answers as (token, logprob) pairs: the same tokens, logprobs within 1e-4."""
    assert [t for t, _ in got] == [t for t, _ in want], what
    assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(got, want)), what


NEAR_TIE = 1e-3  # logits: a greedy step whose two best logits are closer than this is a near-tie


def assert_same_greedy(model, cache, reference, first: list[int], steps: int, tie: float = NEAR_TIE) -> int:
    """Decode ``steps`` greedy tokens after ``first`` from ``cache`` and from
    ``reference`` (two prompt caches of the same tokens, written to) and assert the same
    tokens, up to the first step where the reference's two best logits are within
    ``tie``: two prefills that sum in another order (chunk lengths, BLAS kernels) agree to
    ~1e-6 in their logits, not bit for bit, so only a near-tie may pick another token
    (docs/cache.md, "What exact means"). Returns the number of steps compared."""
    import mlx.core as mx

    x = y = mx.array([first])
    for step in range(steps):
        a, b = model(x, cache=cache)[0, -1], model(y, cache=reference)[0, -1]
        best = mx.sort(b)[-2:]
        if (best[1] - best[0]).item() < tie:
            return step
        ta, tb = mx.argmax(a).item(), mx.argmax(b).item()
        assert ta == tb, f"greedy step {step}: {ta} != {tb} (reference margin {(best[1] - best[0]).item():.2e})"
        x = y = mx.array([[tb]])
    return steps


class EventSink:
    """An engine request's ``sink`` that keeps its events; ``done`` is set at its
    DoneEvent or ErrorEvent; ``tokens`` are the generated token ids."""

    def __init__(self):
        self.events, self.done = [], threading.Event()

    def __call__(self, events):
        self.events.extend(events)
        if any(isinstance(e, (DoneEvent, ErrorEvent)) for e in events):
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [e.token for e in self.events if isinstance(e, TokenEvent)]



def engine_tokens(engine, prompts: list[list[int]], params: list, timeout: float = 120.0) -> list[list[int]]:
    """Submit ``prompts`` (token ids) to ``engine`` as one burst (an idle engine starts them
    together, ``scheduler.admission.arrivals``), each with its ``SamplingParams`` (an int: greedy with
    that ``max_tokens``); wait for all of them and return each one's generated tokens."""
    import uuid

    from scheduler import EngineRequest, SamplingParams

    sinks = [EventSink() for _ in prompts]
    with engine.arrivals.prepare():
        for p, q, s in zip(prompts, params, sinks):
            q = SamplingParams(max_tokens=q) if isinstance(q, int) else q
            engine.submit(EngineRequest(f"t-{uuid.uuid4().hex[:12]}", p, q, s))
    for s in sinks:
        assert s.done.wait(timeout), "a request did not finish"
    return [s.tokens for s in sinks]


def pytest_sessionfinish(session, exitstatus) -> None:
    """End the test process with pytest's status once the run is over, skipping the
    interpreter's teardown, as ``mlx-gateway serve`` does (``gateway.cli._serve_and_exit``):
    MLX threads of the in-process gateways that have just ended still run their C++
    thread-exit destructors, which take the GIL, and a teardown at the same time aborts
    the process (``terminate called without an active exception``, status 134) after every
    test has passed. An ``atexit`` hook, so pytest has written its summary and closed its
    captures first; the status is the session's."""
    import atexit

    def leave(status: int = int(exitstatus)) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)

    atexit.register(leave)


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory):
    """The qwen3 test model quantized to 4 bits (groups of 32) by ``mlx_lm.convert``."""
    import mlx_lm

    out = tmp_path_factory.mktemp("quantized") / "qwen3-q4"
    mlx_lm.convert(str(model_path("qwen3")), mlx_path=str(out), quantize=True, q_group_size=32, q_bits=4)
    return out
