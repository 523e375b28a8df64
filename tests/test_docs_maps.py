"""The docs' "Code" maps name every module of the three floors, and nothing else.

Each floor has one map, in the ``## Code`` section of one doc: a line per module,
``- `path` — its job in one sentence``. The test fails when a module is missing from its
folder's map, when a map names a module that does not exist or that belongs to another
folder, and when a module is named twice. A package's ``__init__.py`` must be mapped only
when it defines a function or a class (re-exports alone are not a job)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# folder -> the doc whose "## Code" section maps it
MAPS = {"gateway": "docs/gateway.md", "scheduler": "docs/scheduling.md", "cache": "docs/cache.md"}
ENTRY = re.compile(r"^- `([^`]+\.py)` — \S")


def code_section(doc: Path) -> list[str]:
    """The lines of ``doc`` from its ``## Code`` heading to the next level-2 heading.

    Raises AssertionError when the doc has no ``## Code`` section."""
    lines = doc.read_text(encoding="utf-8").splitlines()
    assert "## Code" in lines, f"{doc.relative_to(ROOT)} has no '## Code' section"
    start = lines.index("## Code") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def mapped(doc: Path) -> list[str]:
    """The module paths the ``## Code`` section of ``doc`` names, in order, repeats kept."""
    return [m.group(1) for line in code_section(doc) if (m := ENTRY.match(line))]


def must_map(path: Path) -> bool:
    """Whether ``path`` needs a line: every module but an ``__init__.py`` that defines nothing."""
    if path.name != "__init__.py":
        return True
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for n in tree.body)


def modules(folder: str) -> set[str]:
    """The modules under ``folder`` that its map must name, as repository-relative paths."""
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / folder).rglob("*.py") if must_map(p)}


@pytest.mark.parametrize("folder", sorted(MAPS))
def test_every_module_is_mapped(folder):
    names = set(mapped(ROOT / MAPS[folder]))
    missing = sorted(modules(folder) - names)
    assert not missing, f"missing from the Code map of {MAPS[folder]}: {missing}"


@pytest.mark.parametrize("folder", sorted(MAPS))
def test_every_mapped_module_exists(folder):
    names = mapped(ROOT / MAPS[folder])
    assert names, f"{MAPS[folder]}'s Code section has no '- `path` — job' lines"
    foreign = [n for n in names if not n.startswith(folder + "/")]
    assert not foreign, f"{MAPS[folder]} maps {folder}/ only, but names {foreign}"
    gone = [n for n in names if not (ROOT / n).is_file()]
    assert not gone, f"{MAPS[folder]}'s Code map names modules that do not exist: {gone}"
    repeated = sorted({n for n in names if names.count(n) > 1})
    assert not repeated, f"{MAPS[folder]}'s Code map names these twice: {repeated}"


def test_the_check_can_fail(tmp_path):
    """The parser reads only the Code section, and a stale or missing line is noticed."""
    doc = tmp_path / "x.md"
    doc.write_text("# X\n\n- `cache/tree.py` — outside the map.\n\n## Code\n\n"
                   "- `cache/tree.py` — A radix tree.\n- `cache/gone.py` — Moved away.\n\n## After\n\n"
                   "- `cache/pages.py` — after the map.\n", encoding="utf-8")
    names = mapped(doc)
    assert names == ["cache/tree.py", "cache/gone.py"]
    assert "cache/pages.py" in modules("cache") - set(names)
    assert not (ROOT / "cache/gone.py").is_file()
