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


def data_root() -> Path:
    """The data directory (see the module docstring); it may not exist yet."""
    for env in (DATA_ENV, "MLX_GATEWAY_HOME"):
        if os.environ.get(env):
            return Path(os.environ[env]).expanduser()
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Application Support"
    elif os.name == "nt":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    else:
        xdg = os.environ.get("XDG_DATA_HOME", "")
        base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".local" / "share"
    return base / "mlx-gateway"
