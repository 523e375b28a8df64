"""Fixtures of the agent-CLI tests: the pinned CLIs (installed once per cache, see
``install.py``) and the served models.

The sessions run on "terse" tiny models (``session.terse_model``): random weights of a
real architecture (qwen3), loaded by ``mlx_lm.load`` and served through the real path,
edited so that the end-of-turn token follows the first word the model writes
(``terse_weights.py``). A random model never ends its turn on its own,
and agent CLIs treat a turn cut at ``max_tokens`` as unfinished (Claude Code asks for a
continuation, then exits 1).
"""

from __future__ import annotations

import pytest

from .install import Toolbox, install


@pytest.fixture(scope="session")
def toolbox() -> Toolbox:
    """The pinned CLIs, installed (or found) once per test run."""
    return install()
