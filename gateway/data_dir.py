"""The gateway's data directory: what it keeps for its users between runs (the stored
responses of the Responses API), as opposed to the cache directory of
:func:`gateway.models.default_model.cache_root`, which holds only what can be made again.

It is ``$MLX_GATEWAY_DATA_DIR``, else ``$MLX_GATEWAY_HOME``, else the platform's user data
directory plus ``mlx-gateway``: ``$XDG_DATA_HOME`` or ``~/.local/share`` on Linux,
``~/Library/Application Support`` on macOS, ``%LOCALAPPDATA%`` on Windows.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DATA_ENV = "MLX_GATEWAY_DATA_DIR"


def user_dir(envs: tuple[str, ...], darwin: str, xdg_env: str, xdg_default: str) -> Path:
    """``<base>/mlx-gateway``: the first of the environment variables ``envs`` that is set
    (as it is), else the platform's user directory of that kind: ``~/Library/<darwin>`` on
    macOS, ``%LOCALAPPDATA%`` on Windows, ``$<xdg_env>`` (an absolute path) or
    ``~/<xdg_default>`` elsewhere."""
    for env in envs:
        if os.environ.get(env):
            return Path(os.environ[env]).expanduser()
    if sys.platform == "darwin":
        base = Path.home() / "Library" / darwin
    elif os.name == "nt":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    else:
        xdg = os.environ.get(xdg_env, "")
        base = Path(xdg) if os.path.isabs(xdg) else Path.home() / xdg_default
    return base / "mlx-gateway"


def data_root() -> Path:
    """The data directory (see the module docstring); it may not exist yet."""
    return user_dir((DATA_ENV, "MLX_GATEWAY_HOME"), "Application Support", "XDG_DATA_HOME", ".local/share")
