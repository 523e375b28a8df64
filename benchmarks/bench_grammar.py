"""Grammar-engine benchmark for constrained decoding (a script, not a test).

Compares llguidance and xgrammar on a real HF tokenizer (default: the Qwen3 fixture,
~151k tokens). Per engine (each runs only if it imports):
  - vocabulary preparation (llguidance.hf.from_tokenizer /
    xgrammar.TokenizerInfo.from_huggingface + GrammarCompiler);
  - compile time, schema -> ready matcher (median of --repeats), for json_object
    ({"type":"object"}), complex (nested object, enum, integer bounds, maxLength,
    array of objects, required, additionalProperties:false) and tools5 (anyOf of 5
    {"name": {"const": ...}, "arguments": {...}} tool calls);
  - per-token cost while driving the matcher through a valid instance (HF tokens of
    the compact JSON): fill a full-vocabulary int32 bitmask [1, ceil(V/32)], then
    consume the token. "cold" = first walk of a fresh matcher (what one request
    pays), "warm" = later walks after reset(). Mean and p99, microseconds per token;
  - apply cost (only where mlx imports; engine independent): numpy unpackbits ->
    bool row -> mx.array -> mx.where(mask, logits, -inf) -> mx.eval on a float32
    [1, V] row.

Usage (from the repo root; xgrammar needs a virtual environment of its own, since it
pulls in torch, transformers and triton: ``pip install torch xgrammar transformers``):
  python benchmarks/bench_grammar.py --engine llguidance --n-vocab 151936
  XGR_VENV/bin/python benchmarks/bench_grammar.py --engine xgrammar --n-vocab 151936
  see --help for --tokenizer, --compact, --cases, --repeats, --warm-passes, --no-apply
"""

from __future__ import annotations

import argparse
from pathlib import Path
import json
import statistics
import time

import numpy as np


def _obj(props: dict, required: list[str]) -> dict:
    """A closed JSON-schema object."""
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


STR = {"type": "string"}
TOOLS = {
    "get_weather": _obj({"city": STR, "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city"]),
    "search_web": _obj({"query": STR, "max_results": {"type": "integer", "minimum": 1, "maximum": 50}},
                       ["query"]),
    "send_email": _obj({"to": STR, "subject": {"type": "string", "maxLength": 120}, "body": STR},
                       ["to", "subject", "body"]),
    "create_event": _obj({"title": STR, "start": STR,
                          "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 1440},
                          "attendees": {"type": "array", "items": STR, "maxItems": 20}}, ["title", "start"]),
    "calculator": _obj({"expression": {"type": "string", "maxLength": 200}}, ["expression"]),
}

COMPLEX = _obj({
    "id": {"type": "integer", "minimum": 1, "maximum": 10000},
    "name": {"type": "string", "maxLength": 32},
    "status": {"enum": ["active", "inactive", "pending"]},
    "address": _obj({"street": {"type": "string", "maxLength": 64}, "city": STR,
                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, ["street", "city"]),
    "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": _obj({
        "sku": {"type": "string", "maxLength": 16}, "qty": {"type": "integer", "minimum": 1, "maximum": 100},
        "price": {"type": "number"}}, ["sku", "qty"])},
    "tags": {"type": "array", "items": STR, "maxItems": 3},
}, ["id", "name", "status", "items"])

# name -> (schema, valid instance)
CASES = {
    "json_object": ({"type": "object"}, {
        "query": "weather in Paris", "ok": True, "next": None, "results": [
            {"title": "Paris forecast", "score": 0.93, "tags": ["fr", "eu"]},
            {"title": "Météo France", "score": 0.71, "tags": []}]}),
    "complex": (COMPLEX, {
        "id": 4217, "name": "Ada Lovelace", "status": "active",
        "address": {"street": "12 St James's Square", "city": "London", "zip": "12345"},
        "items": [{"sku": "AX-100", "qty": 2, "price": 19.99}, {"sku": "BZ-7", "qty": 10, "price": 0.5},
                  {"sku": "CQ-42", "qty": 1}], "tags": ["vip", "newsletter"]}),
    "tools5": ({"anyOf": [_obj({"name": {"const": n}, "arguments": p}, ["name", "arguments"])
                          for n, p in TOOLS.items()]}, {
        "name": "create_event", "arguments": {
            "title": "Quarterly planning review", "start": "2025-03-14T09:30:00Z",
            "duration_minutes": 90, "attendees": ["alice@example.com", "bob@example.com"]}}),
}


class LLGuidanceEngine:
    """llguidance: LLMatcher per request, numpy int32 bitmask."""

    name = "llguidance"

    def __init__(self, tok, n_vocab: int, compact: bool):
        import llguidance
        import llguidance.hf
        import llguidance.numpy as lln
        self.llg, self.lln = llguidance, lln
        self.opts = {"whitespace_flexible": not compact}
        self.lltok = llguidance.hf.from_tokenizer(tok, n_vocab=n_vocab)
        self.n_vocab = n_vocab

    def compile(self, schema: dict):
        """Schema -> fresh matcher (llguidance compiles in the LLMatcher constructor)."""
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, overrides=self.opts)
        m = self.llg.LLMatcher(self.lltok, grammar)
        assert not m.is_error(), m.get_error()
        return m

    def alloc(self):
        return self.lln.allocate_token_bitmask(1, self.n_vocab)

    def fill(self, m, bitmask) -> None:
        self.lln.fill_next_token_bitmask(m, bitmask)

    def consume(self, m, token: int) -> None:
        assert m.consume_token(token), m.get_error()


class XGrammarEngine:
    """xgrammar: GrammarCompiler (cache off) + GrammarMatcher, torch int32 bitmask on CPU."""

    name = "xgrammar"

    def __init__(self, tok, n_vocab: int, compact: bool):
        import xgrammar as xgr
        self.xgr, self.any_ws, self.n_vocab = xgr, not compact, n_vocab
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=n_vocab)
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)

    def compile(self, schema: dict):
        """Schema -> fresh matcher (compile_json_schema precomputes the token-mask cache)."""
        # any_whitespace=False alone means separators (", ", ": "); compact needs them explicit
        seps = None if self.any_ws else (",", ":")
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=self.any_ws, separators=seps)
        return self.xgr.GrammarMatcher(compiled)

    def alloc(self):
        return self.xgr.allocate_token_bitmask(1, self.n_vocab)

    def fill(self, m, bitmask) -> None:
        m.fill_next_token_bitmask(bitmask)

    def consume(self, m, token: int) -> None:
        assert m.accept_token(token), f"token {token} rejected"


def walk(engine, m, ids: list[int]) -> tuple[list[float], list[float]]:
    """Fill the mask then consume, per token (plus the final mask); return us timings."""
    bitmask, fills, consumes = engine.alloc(), [], []
    for i in range(len(ids) + 1):
        t0 = time.perf_counter()
        engine.fill(m, bitmask)
        t1 = time.perf_counter()
        fills.append((t1 - t0) * 1e6)
        if i < len(ids):
            engine.consume(m, ids[i])
            consumes.append((time.perf_counter() - t1) * 1e6)
    return fills, consumes


def stats(xs: list[float]) -> str:
    """'mean/p99' in microseconds."""
    return f"{statistics.fmean(xs):.1f}/{np.percentile(xs, 99):.1f}"


def bench_engine(cls, tok, args) -> list[str]:
    """Prep, compile and walk every case for one engine; return table rows."""
    t0 = time.perf_counter()
    engine = cls(tok, args.n_vocab, args.compact)
    rows = [f"{cls.name:<11} {'vocab prep':<12} {(time.perf_counter() - t0) * 1e3:10.1f}"]
    for case in args.cases:
        schema, instance = CASES[case]
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            m = engine.compile(schema)
            times.append((time.perf_counter() - t0) * 1e3)
        ids = tok.encode(json.dumps(instance, separators=(",", ":"), ensure_ascii=False), add_special_tokens=False)
        m = engine.compile(schema)
        try:
            cold_f, cold_c = walk(engine, m, ids)
            warm_f, warm_c = [], []
            for _ in range(args.warm_passes):
                m.reset()
                f, c = walk(engine, m, ids)
                warm_f, warm_c = warm_f + f, warm_c + c
        except AssertionError as e:  # the engine rejected the valid instance
            rows.append(f"{cls.name:<11} {case:<12} {statistics.median(times):10.1f} walk FAILED: {e}")
            continue
        rows.append(f"{cls.name:<11} {case:<12} {statistics.median(times):10.1f} {len(ids):5d}  "
                    f"{stats(cold_f):>22} {stats(warm_f):>22}   "
                    f"{statistics.fmean(cold_c):6.1f}/{statistics.fmean(warm_c):.1f}")
    return rows


def bench_apply(n_vocab: int, iters: int = 200) -> list[str]:
    """Time applying an int32 bitmask to an MLX float32 [1, V] logits row.

    Two masks: "random" (half the bits set: worst case for the branchy CPU select)
    and "sparse" (3 tokens allowed, like most constrained steps)."""
    import mlx.core as mx
    words = (n_vocab + 31) // 32
    sparse = np.zeros((1, words), np.int32)
    sparse[0, [3, 150, words - 1]] = 1
    rng = np.random.default_rng(0)
    masks = {"random": rng.integers(-2 ** 31, 2 ** 31, (1, words), dtype=np.int64).astype(np.int32), "sparse": sparse}
    logits = mx.random.normal((1, n_vocab))
    mx.eval(logits)
    rows = []
    for kind, mask in masks.items():
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:n_vocab].astype(bool)
            mx.eval(mx.where(mx.array(bits).reshape(1, n_vocab), logits, -float("inf")))
            ts.append((time.perf_counter() - t0) * 1e6)
        rows.append(f"apply [1,{n_vocab}] {kind} mask (np.unpackbits + mx.where + eval): "
                    f"mean/p99 us {stats(ts)} ({mx.default_device()})")
    return rows


def main() -> None:
    """Parse arguments, run the selected engines, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["llguidance", "xgrammar", "both"], default="both")
    ap.add_argument("--tokenizer", default=str(Path(__file__).resolve().parents[2] / "shared" / "fixtures"
                                               / "tokenizers" / "qwen3"),
                    help="a Hugging Face tokenizer directory (default: the Qwen3 test fixture)")
    ap.add_argument("--n-vocab", type=int, default=None, help="logits width (default len(tokenizer))")
    ap.add_argument("--compact", action="store_true", help="no free whitespace in JSON")
    ap.add_argument("--repeats", type=int, default=5, help="compiles per case (median reported)")
    ap.add_argument("--warm-passes", type=int, default=5)
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    ap.add_argument("--no-apply", action="store_true", help="skip the MLX apply measurement")
    args = ap.parse_args()

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    args.n_vocab = args.n_vocab or len(tok)
    wanted = ["llguidance", "xgrammar"] if args.engine == "both" else [args.engine]
    engines = {"llguidance": LLGuidanceEngine, "xgrammar": XGrammarEngine}
    print(f"tokenizer {args.tokenizer} len={len(tok)} n_vocab={args.n_vocab} "
          f"whitespace={'compact' if args.compact else 'flexible'}")
    print("engine      case         compile ms  toks  cold fill us mean/p99  warm fill us mean/p99"
          "  consume us cold/warm")
    for name in wanted:
        try:
            rows = bench_engine(engines[name], tok, args)
        except ImportError as e:
            rows = [f"{name:<11} skipped: {e}"]
        print("\n".join(rows), flush=True)
    if not args.no_apply:
        try:
            print("\n".join(bench_apply(args.n_vocab)))
        except ImportError:
            print("apply: skipped (mlx not importable)")


if __name__ == "__main__":
    main()
