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
    ns = parser.parse_args(argv)
    if ns.command == "serve":
        from gateway.server import serve

        serve(config_from_args(ns))
    else:
        from gateway.demo_model import build_model_dir

        path = build_model_dir(ns.dir, ns.arch, ns.tokenizer, ns.vocab_size, ns.seed)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
