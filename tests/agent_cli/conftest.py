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

from .install import Toolbox, install_in_background


@pytest.hookimpl(trylast=True)  # after -k, -m and --deselect have left out what they leave out
def pytest_collection_modifyitems(session, config, items) -> None:
    """Run the tests that need the CLIs (the ``toolbox`` fixture) after every other test of
    the run, and start installing the CLIs now, in the background: a first run's install
    (npm and pip, 30-90 s) then overlaps the other tests instead of delaying the first one.
    A run that selects none of them installs nothing. (A hook of this conftest sees every
    item of the run, not only this directory's.)"""
    agents = [item for item in items if "toolbox" in getattr(item, "fixturenames", ())]
    if not agents:
        return
    chosen = set(map(id, agents))
    items[:] = [item for item in items if id(item) not in chosen] + agents
    if not config.option.collectonly and not config.option.maxfail:
        install_in_background()  # (with -x or --maxfail a run may end early: then the fixture installs, if reached)


@pytest.fixture(scope="session")
def toolbox() -> Toolbox:
    """The pinned CLIs, installed (or found) once per test run: the install started at
    collection (:func:`pytest_collection_modifyitems`) is waited for here (started here
    when the run has ``-x`` or ``--maxfail``)."""
    return install_in_background().result()
