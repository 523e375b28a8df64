"""Prefix-cache reuse of one agent conversation through the three APIs (a script, not a test).

A 5-turn agent loop with a tool (each turn: the model must call the tool, the result goes
back, the next turn follows) is run against one gateway three times, the prefix cache
flushed in between: through ``/v1/chat/completions``, through ``/v1/messages`` (Anthropic)
and through ``/v1/responses`` (chained with ``previous_response_id``). For each it prints
the prompt tokens, the cached tokens and the TTFT of every turn; the three rows should
match, since all three render the same conversation and share one cache.

Usage::

    python benchmarks/bench_agent_apis.py [--model DIR | --tokenizer DIR] [--turns 5]

By default the model is a tiny random-weight qwen3 on the real Qwen3 tokenizer (from the
test fixtures), whose chat template puts the tools in the system prompt as Qwen3 does.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scenarios import free_port, gateway_cmd, serving, words  # noqa: E402

TOOL = {"name": "read_file", "description": "Read a file of the project",
        "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 24}},
                       "required": ["path"], "additionalProperties": False}}
SYSTEM = "You are a coding agent. " + words(300, 7)


def task(turn: int) -> str:
    return f"Step {turn}: " + words(40, 100 + turn)


def chat(c: httpx.Client, turns: int) -> list[dict]:
    messages, out = [{"role": "system", "content": SYSTEM}], []
    for t in range(turns):
        messages.append({"role": "user", "content": task(t)})
        t0 = time.monotonic()
        r = c.post("/v1/chat/completions", json={
            "messages": messages, "tools": [{"type": "function", "function": TOOL}], "tool_choice": "required",
            "parallel_tool_calls": False, "max_tokens": 40, "temperature": 0}).raise_for_status().json()
        call = r["choices"][0]["message"]["tool_calls"][0]
        out.append({"prompt": r["usage"]["prompt_tokens"], "cached": r["usage"]["prompt_tokens_details"]["cached_tokens"],
                    "seconds": time.monotonic() - t0})
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"contents of file {t}"})
    return out


def anthropic(c: httpx.Client, turns: int) -> list[dict]:
    messages, out = [], []
    tool = {"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}
    results: list[dict] = []
    for t in range(turns):
        messages.append({"role": "user", "content": results + [{"type": "text", "text": task(t)}]})
        t0 = time.monotonic()
        r = c.post("/v1/messages", json={
            "system": SYSTEM, "messages": messages, "tools": [tool], "max_tokens": 40, "temperature": 0,
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}).raise_for_status().json()
        use = r["usage"]
        out.append({"prompt": use["input_tokens"] + use["cache_read_input_tokens"] + use["cache_creation_input_tokens"],
                    "cached": use["cache_read_input_tokens"], "seconds": time.monotonic() - t0})
        calls = [b for b in r["content"] if b["type"] == "tool_use"]
        messages.append({"role": "assistant", "content": calls})
        results = [{"type": "tool_result", "tool_use_id": calls[0]["id"], "content": f"contents of file {t}"}]
    return out


def responses(c: httpx.Client, turns: int) -> list[dict]:
    out, previous, results = [], None, []
    for t in range(turns):
        body = {"instructions": SYSTEM, "input": results + [{"role": "user", "content": task(t)}],
                "tools": [{"type": "function", **TOOL}], "tool_choice": "required", "parallel_tool_calls": False,
                "max_output_tokens": 40, "temperature": 0}
        if previous:
            body["previous_response_id"] = previous
        t0 = time.monotonic()
        r = c.post("/v1/responses", json=body).raise_for_status().json()
        out.append({"prompt": r["usage"]["input_tokens"], "cached": r["usage"]["input_tokens_details"]["cached_tokens"],
                    "seconds": time.monotonic() - t0})
        call = next(i for i in r["output"] if i["type"] == "function_call")
        previous = r["id"]
        results = [{"type": "function_call_output", "call_id": call["call_id"], "output": f"contents of file {t}"}]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory, or 'demo'")
    ap.add_argument("--tokenizer", default=str(ROOT.parent / "shared" / "fixtures" / "tokenizers" / "qwen3"),
                    help="without --model: a tiny random qwen3 is built on this tokenizer directory")
    ap.add_argument("--turns", type=int, default=5)
    args = ap.parse_args()
    if args.model is None:
        import tempfile

        from gateway.models.demo_model import build_model_dir

        name = "mlx-gateway-bench-agent-" + Path(args.tokenizer).name
        args.model = str(build_model_dir(Path(tempfile.gettempdir()) / name, "qwen3", tokenizer_dir=args.tokenizer))
    port = free_port()
    with serving(gateway_cmd(port, "--model", args.model, "--log-level", "WARNING"), port) as (url, _), \
            httpx.Client(base_url=url, timeout=600) as c:
        print(f"model: {args.model}, {args.turns} turns, tool_choice required")
        for name, fn in (("chat.completions", chat), ("messages", anthropic), ("responses", responses)):
            c.post("/admin/cache/flush").raise_for_status()
            rows = fn(c, args.turns)
            prompt, cached = sum(r["prompt"] for r in rows), sum(r["cached"] for r in rows)
            print(f"{name:17s} prompt/turn={[r['prompt'] for r in rows]} cached/turn={[r['cached'] for r in rows]} "
                  f"reused={cached / prompt:.3f} seconds/turn={json.dumps([round(r['seconds'], 2) for r in rows])}")


if __name__ == "__main__":
    main()
