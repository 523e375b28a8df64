"""The ``mlx-gateway`` command: ``serve`` and ``demo-model``."""

from __future__ import annotations

import argparse
import sys

from gateway.config import add_serve_arguments, config_from_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mlx-gateway", description="A multi-tenant, OpenAI-compatible serving gateway for MLX models."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve_p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_serve_arguments(serve_p)
    demo_p = sub.add_parser("demo-model", help="write a tiny random-weight model directory")
    demo_p.add_argument("dir", help="directory to write")
    from gateway.demo_model import ARCH_CONFIGS

    demo_p.add_argument("--arch", default="qwen3", choices=sorted(ARCH_CONFIGS), help="architecture")
    demo_p.add_argument("--tokenizer", help="copy this tokenizer directory instead of the built-in one")
    demo_p.add_argument("--vocab-size", type=int, help="embedding rows (default: the tokenizer's size)")
    demo_p.add_argument("--seed", type=int, default=0, help="weights seed")
    keys_p = sub.add_parser("keys", help="API keys for the tenants file")
    keys_sub = keys_p.add_subparsers(dest="keys_command", required=True)
    new_p = keys_sub.add_parser("new", help="print a new API key once, and the line to paste into the tenants file")
    new_p.add_argument("tenant", help="tenant name (a [tenants.NAME] table); 'admin' for an admin key")
    ns = parser.parse_args(argv)
    if ns.command == "keys":
        return _new_key(ns.tenant)
    if ns.command == "serve":
        from gateway.server import serve

        serve(config_from_args(ns))
    else:
        from gateway.demo_model import build_model_dir

        path = build_model_dir(ns.dir, ns.arch, ns.tokenizer, ns.vocab_size, ns.seed)
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
