"""``mlx-gateway tune``: the command (see :mod:`gateway.tuning`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model directory or hub id (default: the default model, fetched if needed)")
    p.add_argument("--replay", type=Path, metavar="LOG",
                   help="replay a request log (serve --log-format json) instead of the synthetic workload")
    p.add_argument("--budget", type=float, default=900, metavar="SECONDS",
                   help="time for the whole sweep; settings that would pass it are skipped (default %(default)s)")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="time one setting's run may take (default: 3x the base setting's, at least 60)")
    p.add_argument("--max-gap", type=float, default=0.35, metavar="SECONDS",
                   help="inter-token gap p99 a recommended setting must keep (default %(default)s)")
    p.add_argument("--burst", type=int, default=6, help="chats of the burst sharing a system prompt (default 6)")
    p.add_argument("--streams", type=int, default=6, help="interactive streams (default 6)")
    p.add_argument("--agents", type=int, default=2, help="agent requests (default 2)")
    p.add_argument("--agent-tokens", type=int, default=4000, help="an agent request's prompt tokens (default 4000)")
    p.add_argument("--prompt-concurrency", type=int, default=8, help="base setting (default: serve's, 8)")
    p.add_argument("--prefill-step-size", type=int, default=2048, help="base setting (default: serve's, 2048)")
    p.add_argument("--prefill-budget", type=float, default=0.2, help="base setting (default: serve's, 0.2)")
    p.add_argument("--values", action="append", default=[], metavar="FLAG=V1,V2",
                   help="the values tried for one flag, e.g. prefill-budget=0.1,0.3 (repeatable; "
                        "FLAG= tries none but the base)")
    p.add_argument("--serve-args", default="", help="more `serve` flags for every setting, e.g. '--kv-bits 8'")
    p.add_argument("--out", type=Path, default=Path("."), help="where tune.md, tune.json and tune.png go (default .)")


def _values(specs: list[str]) -> dict:
    from gateway.tuning.sweep import FLAGS, SWEEP

    values = {k: list(v) for k, v in SWEEP.items()}
    for spec in specs:
        name, _, raw = spec.partition("=")
        key = name.strip().lstrip("-").replace("-", "_")
        if key not in values:
            raise SystemExit(f"mlx-gateway tune: --values: unknown flag {name!r} (one of "
                             f"{', '.join(k.replace('_', '-') for k in FLAGS)})")
        cast = float if key == "prefill_budget" else int
        try:
            values[key] = [cast(x) for x in raw.split(",") if x.strip()]
        except ValueError:
            raise SystemExit(f"mlx-gateway tune: --values {spec}: not numbers")
    return values


def _model_dir(model: str | None) -> str:
    """The directory of ``model`` as ``serve`` resolves it (``demo``, ``default``, a
    directory, a hub id)."""
    from gateway.models.loader import resolve_path
    from gateway.models.spec import ModelSpec

    try:
        path = resolve_path(ModelSpec(name="tune", path=model or "default"))
        if not Path(path).is_dir():
            from compat.mlx_lm import download

            path = str(download(path))
    except Exception as e:  # a path that is not there, a hub id that cannot be fetched
        raise SystemExit(f"mlx-gateway tune: cannot use the model {model or 'default'!r}: {e}")
    return str(path)


def _bias(model_dir: str) -> tuple[dict, int]:
    """EOS banned (and, for a vocabulary of at most 4096, the byte tokens a stream holds
    back), and the vocabulary size."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(Path(model_dir))
    vocab = len(tok._tokenizer.get_vocab())
    banned = set(tok.eos_token_ids)
    if vocab <= 4096:
        banned |= {i for i in range(vocab) if "\ufffd" in tok.decode([i])}
    return {str(t): -100 for t in sorted(banned)}, vocab


def run(ns: argparse.Namespace) -> int:
    """Run the sweep, print the table and the recommended flags, write the files."""
    # Imported here: every command's parser is built from this module, and these import httpx.
    from gateway.tuning import report
    from gateway.tuning.sweep import flags_of, recommend, settings, sweep
    from gateway.tuning.workload import from_log, prompts, synthetic

    values = _values(ns.values)
    base = {"prompt_concurrency": ns.prompt_concurrency, "prefill_step_size": ns.prefill_step_size,
            "prefill_budget": ns.prefill_budget}
    model_dir = _model_dir(ns.model)
    try:
        requests = from_log(ns.replay) if ns.replay else synthetic(
            burst=ns.burst, streams=ns.streams, agents=ns.agents, agent_tokens=ns.agent_tokens)
    except (OSError, ValueError) as e:
        raise SystemExit(f"mlx-gateway tune: {e}")
    bias, vocab = _bias(model_dir)
    token_prompts = prompts(requests, vocab)
    print(f"model: {model_dir}\nworkload: {len(requests)} requests, "
          f"{sum(r.tokens for r in requests)} prompt tokens "
          f"({'replay of ' + str(ns.replay) if ns.replay else 'burst, streams and agents'}); "
          f"budget {ns.budget:.0f} s", flush=True)
    bar = report.Progress()
    bar.update(0, len(settings(base, values)), 0.0, "starting the base setting")

    def on_result(i: int, n: int, r, elapsed: float) -> None:
        note = (f"{flags_of(r.setting)}: " + (f"TTFT p95 {r.figures['ttft_p95']:.2f} s, {r.figures['tok_s']:.1f} tok/s"
                                             if r.figures else f"skipped ({r.skipped})"))
        bar.update(i + 1, n, elapsed, note)

    results = sweep(model_dir, requests, token_prompts, bias, base, ns.budget, ns.serve_args.split(), ns.timeout,
                    on_result, values)
    bar.close()
    md = report.table(results)
    best = recommend(results, ns.max_gap)
    print(md)
    advice = f"recommended: {flags_of(best.setting)}" if best else "no setting ran: nothing to recommend"
    print(advice)
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "tune.md").write_text(md + "\n\n" + advice + "\n")
    (ns.out / "tune.json").write_text(json.dumps(
        [{"setting": r.setting, "figures": r.figures, "skipped": r.skipped, "start_s": r.start_s} for r in results],
        indent=1))
    if report.plot(results, ns.out / "tune.png"):
        print(f"plot: {ns.out / 'tune.png'}")
    else:
        print("matplotlib is not installed: no plot (pip install 'mlx-gateway[bench]')", file=sys.stderr)
    return 0 if best else 1
