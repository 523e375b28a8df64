"""The agent CLIs under test, pinned, installed once into the test cache and found there.

- Claude Code, Codex CLI, Qwen Code and opencode come from the npm registry, installed
  with ``npm install --ignore-scripts`` into ``<cache>/npm-<hash of the pins>/``. Their
  packages ship native binaries in per-platform packages, which are run directly (Claude
  Code's and opencode's postinstall scripts only link them; skipping the scripts makes the
  install the same under every npm version). Codex's and Qwen Code's entry points are Node
  scripts: they run on a Node.js of at least :data:`NODE_MAJOR` (Qwen Code's declared
  engine; it fails on Node 18, which lacks ``fs.openAsBlob``): the system's when it is new
  enough, else a pinned Node.js from the same registry (``node-<os>-<arch>``), installed
  alongside.
- aider comes from PyPI into its own virtual environment, ``<cache>/aider-<version>/``:
  its pins (litellm, openai) conflict with the test environment's.

The cache is ``$MLX_GATEWAY_TEST_AGENTS``, else ``.test-agents/`` at the repository root
(git ignores it). A finished install carries a ``.complete`` stamp and is reused; an
interrupted one is removed and redone. Each install holds its own lock file (aider's and
each set of npm pins: they run side by side), so parallel test runs share one cache.
About 1.5 GB (npm, with Node.js) and 0.7 GB (aider); 30-90 s each. A test run starts the
install in the background as soon as it has collected a test that needs the CLIs
(:func:`install_in_background`, from ``conftest.py``, which also runs those tests last), so
a first run installs them while the other tests run; npm and pip run under ``nice`` and,
where it runs, ``ionice -c3``, so the tests keep most of the CPU and the disk.
Other tests install their npm pins the same way, through :func:`npm_packages` (the
``ollama`` npm package of ``tests/clients/test_ollama_js.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("MLX_GATEWAY_TEST_AGENTS") or ROOT / ".test-agents")

# The releases under test (they change what they send between releases).
NPM_PINS = {
    "claude": ("@anthropic-ai/claude-code", "2.1.328"),
    "codex": ("@openai/codex", "0.169.0"),
    "qwen": ("@qwen-code/qwen-code", "0.24.4"),
    "opencode": ("opencode-ai", "1.18.33"),
}
AIDER_PIN = ("aider-chat", "0.86.2")
NODE_MAJOR = 22  # the engines field of @qwen-code/qwen-code and @anthropic-ai/claude-code
NODE_PIN = "22.23.3"  # installed from the registry when the system's Node.js is older
# Platforms whose Node.js the registry has as node-<platform>@NODE_PIN.
NODE_PLATFORMS = ("linux-x64", "linux-arm64", "darwin-x64")
CLIS = (*NPM_PINS, "aider")


@dataclass
class Toolbox:
    """Where each CLI's command starts (``argv`` prefix by name) and why a CLI is missing."""

    argv: dict[str, list[str]] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)
    node: Optional[str] = None  # the Node.js that runs the Node-script CLIs

    def command(self, name: str) -> list[str]:
        """The ``argv`` prefix of CLI ``name``; skips the calling test, saying why, when it
        could not be installed."""
        import pytest

        if name not in self.argv:
            pytest.skip(f"{name} is not installed: {self.missing.get(name, 'unknown reason')}")
        return list(self.argv[name])


def node_platform() -> str:
    """This machine as Node.js names it: ``linux-x64``, ``darwin-arm64``, ..."""
    machine = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine().lower(), platform.machine().lower())
    return f"{sys.platform if sys.platform != 'win32' else 'win32'}-{machine}"


def _major(version_text: str) -> int:
    m = re.search(r"v?(\d+)\.", version_text)
    return int(m.group(1)) if m else 0


@contextlib.contextmanager
def _locked(cache: Path, what: str) -> Iterator[None]:
    """Hold ``<cache>/.install-<what>.lock`` (one lock per install: aider's and each set of
    npm pins, so that different installs run side by side while two test runs never
    install the same one)."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".install-{what}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _run(argv: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)


def _niced(argv: list[str]) -> list[str]:
    """``argv`` under ``nice`` (a lower CPU priority) and ``ionice -c3`` (disk only when
    idle) where they are: an install may run beside the tests (:func:`install_in_background`)."""
    nice = shutil.which("nice")
    argv = [nice, "-n", "10", *argv] if nice else argv
    return [*_idle_io(), *argv]


@functools.cache
def _idle_io() -> list[str]:
    """``ionice -c3`` where it runs (a container may refuse to set I/O priorities); tried
    once, at the first install that needs it."""
    ionice = shutil.which("ionice")
    if ionice is None or not sys.platform.startswith("linux"):
        return []
    try:
        return [ionice, "-c3"] if subprocess.run([ionice, "-c3", "true"], capture_output=True, timeout=10).returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired):
        return []


def _tail(text: str, n: int = 600) -> str:
    return " ".join(text.split())[-n:]


def _npm_install(cache: Path, specs: list[str]) -> tuple[Optional[Path], str]:
    """``node_modules`` holding ``specs`` (installed now unless a finished copy exists), or
    None and why not."""
    npm = shutil.which("npm")
    if npm is None:
        return None, "no npm on PATH (install Node.js and npm; .ci/run installs them with apt-get or brew)"
    key = hashlib.sha256("\n".join(sorted(specs)).encode()).hexdigest()[:12]
    final = cache / f"npm-{key}"
    if (final / ".complete").exists():
        return final / "node_modules", ""
    with _locked(cache, f"npm-{key}"):
        if (final / ".complete").exists():
            return final / "node_modules", ""
        tmp = cache / f".npm-{key}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            r = _run(_niced([npm, "install", "--prefix", str(tmp), "--ignore-scripts", "--no-audit", "--no-fund",
                             "--save-exact", "--loglevel=error", *specs]), timeout=900)
        except subprocess.TimeoutExpired:
            shutil.rmtree(tmp, ignore_errors=True)
            return None, f"npm install {' '.join(specs)} took over 900 s"
        if r.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            return None, f"npm install {' '.join(specs)} failed ({r.returncode}): {_tail(r.stderr or r.stdout)}"
        (tmp / ".complete").write_text("\n".join(specs) + "\n")
        os.rename(tmp, final)
    return final / "node_modules", ""


def _aider_install(cache: Path) -> tuple[Optional[Path], str]:
    """The aider executable in its own virtual environment (installed now unless a
    finished one exists), or None and why not."""
    name, version = AIDER_PIN
    venv = cache / f"aider-{version}"
    exe = venv / "bin" / "aider"
    if (venv / ".complete").exists():
        return exe, ""
    with _locked(cache, "aider"):
        if (venv / ".complete").exists():
            return exe, ""
        shutil.rmtree(venv, ignore_errors=True)
        try:
            r = _run(_niced([sys.executable, "-m", "venv", str(venv)]), timeout=300)
            if r.returncode == 0:
                r = _run(_niced([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                                 f"{name}=={version}"]), timeout=1200)
        except subprocess.TimeoutExpired:
            shutil.rmtree(venv, ignore_errors=True)
            return None, f"pip install {name}=={version} timed out"
        if r.returncode != 0 or not exe.exists():
            shutil.rmtree(venv, ignore_errors=True)
            return None, f"pip install {name}=={version} into its own venv failed: {_tail(r.stderr or r.stdout)}"
        (venv / ".complete").write_text(f"{name}=={version}\n")
    return exe, ""


def _first(paths: list[Path]) -> Optional[Path]:
    return next((p for p in paths if p.is_file() and os.access(p, os.X_OK)), None)


def _locate(modules: Path, node: str, plat: str) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Each npm CLI's command inside ``modules``, or why it is not there."""
    variants = [plat, f"{plat}-musl", f"{plat}-baseline", f"{plat}-baseline-musl"]
    found = {
        "claude": _first([modules / "@anthropic-ai" / f"claude-code-{v}" / "claude" for v in variants]),
        "opencode": _first([modules / f"opencode-{v}" / "bin" / "opencode" for v in variants]),
        "codex": modules / "@openai" / "codex" / "bin" / "codex.js",
        "qwen": modules / "@qwen-code" / "qwen-code" / "cli.js",
    }
    argv, missing = {}, {}
    for name, path in found.items():
        if path is None or not path.is_file():
            missing[name] = f"{NPM_PINS[name][0]}@{NPM_PINS[name][1]} has no binary for {plat} in {modules}"
        else:
            argv[name] = [node, str(path)] if path.suffix == ".js" else [str(path)]
    return argv, missing


def _check_versions(box: Toolbox) -> None:
    """Move a CLI whose ``--version`` fails or names another release to ``missing``."""
    pins = {**{k: v for k, (_, v) in NPM_PINS.items()}, "aider": AIDER_PIN[1]}

    def version(argv: list[str]) -> tuple[Optional[subprocess.CompletedProcess], str]:
        try:
            r = _run(_niced([*argv, "--version"]), timeout=120, stdin=subprocess.DEVNULL)
            return r, (r.stdout + r.stderr).strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, str(e)

    with ThreadPoolExecutor(max_workers=len(box.argv) or 1) as pool:  # each one starts a runtime
        answers = dict(zip(box.argv, pool.map(version, box.argv.values())))
    for name, argv in list(box.argv.items()):
        r, out = answers[name]
        if r is None or r.returncode != 0 or pins[name] not in out:
            box.missing[name] = f"`{' '.join(argv)} --version` did not print {pins[name]}: {_tail(out, 300)}"
            del box.argv[name]


def npm_packages(specs: list[str], node_major: int, cache: Path = CACHE) -> tuple[Optional[Path], Optional[str], str]:
    """Install (or reuse) the npm packages ``specs`` (exact pins, ``name@version``) under
    ``cache`` with the machine's npm, and find a Node.js of at least ``node_major`` to run
    them: the system's when it is new enough, else the pinned ``node-<os>-<arch>@NODE_PIN``
    from the registry, installed alongside.

    Returns ``(node_modules, node, "")``, or ``None`` in place of what is missing and why
    (no npm, npm failed, no Node.js); never raises for that. Where the system's Node.js is
    older and the registry has none for this platform, ``node`` is the older one and ``why``
    says so (what needs less than ``node_major`` may still run on it).
    """
    plat = node_platform()
    system_node = shutil.which("node")
    system_major = _major(_run([system_node, "--version"], timeout=30).stdout) if system_node else 0
    own_node = system_major < node_major and plat in NODE_PLATFORMS
    modules, why = _npm_install(cache, [*specs, f"node-{plat}@{NODE_PIN}"] if own_node else list(specs))
    if modules is None:
        return None, None, why
    node = str(modules / f"node-{plat}" / "bin" / "node") if own_node else system_node
    if node is None or (not own_node and system_major < node_major):
        return modules, node, f"no Node.js {node_major} or newer (the system's is {system_major or 'missing'})"
    return modules, node, ""


def install(cache: Path = CACHE) -> Toolbox:
    """Install (or reuse) every pinned CLI under ``cache`` and return where each one is.

    Never raises for a CLI that cannot be installed: it is listed in ``missing`` with the
    reason (no npm, npm or pip failed, no binary for this platform, wrong version).
    """
    box = Toolbox()
    specs = [f"{pkg}@{version}" for pkg, version in NPM_PINS.values()]
    with ThreadPoolExecutor(max_workers=2) as pool:  # npm and pip download side by side
        npm = pool.submit(npm_packages, specs, NODE_MAJOR, cache)
        aider = pool.submit(_aider_install, cache)
        (modules, node, why), (exe, aider_why) = npm.result(), aider.result()
    if modules is None:
        box.missing.update({name: why for name in NPM_PINS})
    else:
        if node is None:
            box.missing.update({n: why for n in ("codex", "qwen")})
            node = "node"
        box.node = node
        argv, missing = _locate(modules, node, node_platform())
        box.argv.update(argv)
        box.missing.update(missing)
    if exe is None:
        box.missing["aider"] = aider_why
    else:
        box.argv["aider"] = [str(exe)]
    _check_versions(box)
    return box


_background: dict[Path, Future] = {}
_background_lock = threading.Lock()


def install_in_background(cache: Path = CACHE) -> Future:
    """:func:`install` of ``cache`` in a thread of its own, started at the first call (of
    this process); every call returns its Future (a :class:`Toolbox`). The thread is not a
    daemon: a test run that ends first waits for the npm and pip processes it started
    rather than leaving them running (a run with ``-x`` or ``--maxfail`` does not start
    it at collection: ``conftest.py``)."""
    with _background_lock:
        if cache not in _background:
            done: Future = Future()

            def run() -> None:
                try:
                    done.set_result(install(cache))
                except BaseException as e:
                    done.set_exception(e)

            threading.Thread(target=run, name="agent-cli-install").start()
            _background[cache] = done
        return _background[cache]
