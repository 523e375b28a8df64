"""What ``mlx-gateway tune`` prints and writes: a progress bar while it runs, the table
of settings and figures, and a PNG plot (matplotlib, ``pip install 'mlx-gateway[bench]'``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from gateway.tuning.sweep import FLAGS, Result

COLUMNS = ("ttft_p50", "ttft_p95", "gap_p99", "gap_max", "tok_s", "failed")
HEADERS = {"prompt_concurrency": "prompt-concurrency", "prefill_step_size": "prefill-step-size",
           "prefill_budget": "prefill-budget (s)", "ttft_p50": "TTFT p50 (s)", "ttft_p95": "TTFT p95 (s)",
           "gap_p99": "gap p99 (s)", "gap_max": "gap max (s)", "tok_s": "tokens/s", "failed": "failed"}


def progress(done: int, total: int, elapsed: float, width: int = 24) -> str:
    """``[#########---------------] 3/8 settings, 42 s`` (no newline)."""
    filled = int(round(width * done / total)) if total else width
    return f"[{'#' * filled}{'-' * (width - filled)}] {done}/{total} settings, {elapsed:.0f} s"


class Progress:
    """Redraws the bar in place on a terminal; prints one line per setting elsewhere."""

    def __init__(self, stream: TextIO = sys.stderr) -> None:
        self.stream = stream
        self.tty = stream.isatty()

    def update(self, done: int, total: int, elapsed: float, note: str = "") -> None:
        line = progress(done, total, elapsed) + (f"  {note}" if note else "")
        self.stream.write(("\r\x1b[K" + line) if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _cell(name: str, value) -> str:
    if isinstance(value, float):
        return f"{value:.1f}" if name == "tok_s" else (f"{value:g}" if name in FLAGS else f"{value:.3f}")
    return str(value)


def row(r: Result) -> str:
    cells = [_cell(k, r.setting[k]) for k in FLAGS]
    if r.figures:
        cells += [_cell(k, r.figures[k]) for k in COLUMNS]
    else:
        cells += [f"skipped: {r.skipped}"] + [""] * (len(COLUMNS) - 1)
    return "| " + " | ".join(cells) + " |"


def table(results: list[Result]) -> str:
    """A markdown table: one row per setting."""
    names = [*FLAGS, *COLUMNS]
    return "\n".join(["| " + " | ".join(HEADERS[k] for k in names) + " |", "|" + "---|" * len(names),
                      *(row(r) for r in results)])


def plot(results: list[Result], path: Path) -> bool:
    """Bars of TTFT p50/p95, gap p99 and tokens/s per setting, written to ``path``; False
    (nothing written) when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in results if r.figures]
    labels = ["\n".join(f"{HEADERS[k].split(' ')[0]}={r.setting[k]:g}" for k in FLAGS) for r in ran]
    fig, axes = plt.subplots(1, 3, figsize=(max(9, 1.3 * len(ran) * 3), 4))
    x = list(range(len(ran)))
    axes[0].bar([i - 0.2 for i in x], [r.figures["ttft_p50"] for r in ran], width=0.4, label="p50")
    axes[0].bar([i + 0.2 for i in x], [r.figures["ttft_p95"] for r in ran], width=0.4, label="p95")
    axes[0].set_title("TTFT (s)")
    axes[0].legend(fontsize=8)
    axes[1].bar(x, [r.figures["gap_p99"] for r in ran])
    axes[1].set_title("inter-token gap p99 (s)")
    axes[2].bar(x, [r.figures["tok_s"] for r in ran])
    axes[2].set_title("output tokens/s")
    for ax in axes:
        ax.set_xticks(x, labels, fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
