"""One agent CLI's headless session against a served model, recorded end to end.

:func:`agent_session` starts, for one CLI: a gateway (a LiveServer in this process, with
``log_prompts``), the recording proxy in front of it, the refusing egress proxy, and a
working directory that is a tiny git repository with one file; the CLI's HOME and config
live under the test's ``tmp_path``. :meth:`AgentSession.turn` runs one turn of the CLI as
a subprocess and returns what it printed and which requests it made.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from conftest import ROOT, free_port, live_server, model_path

from .clis import KEY, AgentCLI, offline_env
from .egress import Refusals, refusing_proxy
from .install import CACHE
from .recorder import Exchange, Recorder, recording, sanitized
from .reuse import RequestLog, request_log
from .terse_weights import terse_copy

TURN_TIMEOUT = 300  # seconds one CLI turn may take (a cold 12k-token prefill takes ~15 s here)
FIXTURES = Path(__file__).resolve().parent / "fixtures"
# Set to record the bodies each CLI sends as tests/agent_cli/fixtures/<cli>/*.json.
RECORD_ENV = "MLX_GATEWAY_RECORD_AGENT_FIXTURES"
MODEL_CACHE = Path(os.environ.get("MLX_GATEWAY_TEST_MODELS", ROOT / ".test-models"))


def terse_model(tokenizer: str | None) -> Path:
    """The terse tiny qwen3 on the ``tokenizer`` fixture ("qwen3": Qwen3's tokenizer and
    chat template), or on the project's own BPE and the demo model's template (None, as
    ``--model demo``); built once."""
    return terse_copy(model_path("qwen3", tokenizer), MODEL_CACHE / f"qwen3-{tokenizer or 'own'}-terse")


@dataclass
class Turn:
    """One CLI run: its arguments, exit status, output, wall time (s), and the exchanges
    it made (in arrival order)."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    exchanges: list[Exchange]

    def failure(self) -> str:
        """What the CLI printed, for assertion messages."""
        return f"`{' '.join(self.argv[-6:])}` exited {self.returncode}\nstdout: {self.stdout[-1500:]}\n" \
               f"stderr: {self.stderr[-1500:]}"


@dataclass
class AgentSession:
    """A CLI wired to a gateway: ``server`` (LiveServer), ``recorder`` (its exchanges),
    ``log`` (the gateway's request records), ``refusals`` (hosts the CLI tried to reach
    through the egress proxy), ``home``/``work`` (its HOME and working directory)."""

    cli: AgentCLI
    command: list[str]
    server: object
    recorder: Recorder
    log: RequestLog
    refusals: Refusals
    root: Path
    home: Path
    work: Path
    env: dict[str, str]
    turns: list[Turn] = field(default_factory=list)

    def turn(self, index: int) -> Turn:
        """Run turn ``index`` of the CLI (its ``turns[index]`` arguments) to its end."""
        argv = [*self.command, *self.cli.turns[index]]
        before = len(self.recorder.snapshot())
        t0 = time.monotonic()
        try:
            r = subprocess.run(argv, cwd=self.work, env=self.env, stdin=subprocess.DEVNULL, capture_output=True,
                               text=True, timeout=TURN_TIMEOUT)
            out = (r.returncode, r.stdout, r.stderr)
        except subprocess.TimeoutExpired as e:
            out = (-1, _text(e.stdout), _text(e.stderr) + f"\n(killed after {TURN_TIMEOUT} s)")
        self.server.engine.wait_idle(30)
        turn = Turn(argv, *out, time.monotonic() - t0, self.recorder.snapshot()[before:])
        self.turns.append(turn)
        return turn

    def replacements(self) -> dict[str, str]:
        """Machine-specific strings and the API key, and what fixtures say instead (paths
        also as CLIs fold them into directory names: every other character a dash)."""
        paths = {str(self.work): "/home/user/project", str(self.home): "/home/user", str(self.root): "/tmp/session",
                 str(CACHE): "/opt/agents", str(ROOT): "/src/mlx-gateway"}
        folded = {re.sub(r"[^A-Za-z0-9]", "-", k): re.sub(r"[^A-Za-z0-9]", "-", v) for k, v in paths.items()}
        return {**paths, **folded, KEY: "<secret>"}

    def save_fixtures(self, directory: Path) -> list[Path]:
        """Write every recorded request (method, path, query, headers, body, the status it
        got) as ``directory/NN-turnT-<path>.json``, machine paths and keys replaced;
        earlier files there are removed first."""
        directory.mkdir(parents=True, exist_ok=True)
        for old in directory.glob("*.json"):
            old.unlink()
        written = []
        n = 0
        for t, turn in enumerate(self.turns, 1):
            for ex in turn.exchanges:
                n += 1
                slug = re.sub(r"[^a-z0-9]+", "-", ex.path.lower()).strip("-")
                record = {"method": ex.method, "path": ex.path, "query": ex.query, "headers": ex.headers,
                          "body": ex.body, "recorded_status": ex.status}
                path = directory / f"{n:02d}-turn{t}-{slug}.json"
                path.write_text(json.dumps(sanitized(record, self.replacements()), indent=1, ensure_ascii=False)
                                + "\n")
                written.append(path)
        return written


def _text(data) -> str:
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else (data or "")


def _git_repo(work: Path) -> None:
    work.mkdir(parents=True)
    (work / "hello.py").write_text('print("hello")\n')
    git = ["git", "-c", "user.name=Test", "-c", "user.email=test@example.com", "-c", "init.defaultBranch=main"]
    for args in (["init", "-q"], ["add", "hello.py"], ["commit", "-q", "-m", "hello"]):
        subprocess.run([*git, *args], cwd=work, check=True, capture_output=True)


@contextlib.contextmanager
def agent_session(cli: AgentCLI, command: list[str], model_dir: Path, root: Path, node: Optional[str] = None,
                  **config) -> Iterator[AgentSession]:
    """A gateway serving ``model_dir`` as ``test-model`` (ServeConfig overrides
    ``config``), the recording and egress proxies, and ``cli`` configured to use them
    (HOME ``root/home``, working directory ``root/project``, ``node``'s directory first on
    its PATH)."""
    home, work = root / "home", root / "project"
    home.mkdir(parents=True)
    _git_repo(work)
    port = free_port()
    with live_server(model_dir, log_prompts=True, log_format="json", **config) as server, \
            request_log() as log, recording(server.url, port) as recorder, \
            refusing_proxy() as (proxy, refusals):
        base = f"http://127.0.0.1:{port}"
        env = {**offline_env(home, proxy), **cli.configure(home, base)}
        if node:
            env["PATH"] = f"{Path(node).parent}{os.pathsep}{env['PATH']}"
        if os.environ.get("LD_LIBRARY_PATH"):
            env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
        yield AgentSession(cli, command, server, recorder, log, refusals, root, home, work, env)

