"""docs/architecture.md names the code as it is: every file it cites exists, and every function, class or method
it names is defined in one of the files it cites (vLLM's own names and series names aside)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE = (REPO / "docs" / "architecture.md").read_text()
CITED_FILES = sorted(set(re.findall(r"`((?:exporter|protocol|tests)/[\w/]*\.py)`", PAGE)))
CITED_FOLDERS = sorted(set(re.findall(r"`((?:exporter|protocol|tests)/[\w/]*/)`", PAGE)))
# Code names: a name, or a class and one of its attributes (file names, flags, paths and series are no code).
NAMED = sorted(set(re.findall(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)`", PAGE)) - {"__init__.py"})
# What the page names of vLLM (wrapped or read by the plugin), the series it names, and the tests' marker.
NOT_OURS = {"EngineCoreProc._make_ready_response", "MPClient._apply_ready_response", "KVCacheConfig", "slow"}


def defined_in(path: Path) -> set[str]:
    """The module-level names a file defines, and ``Class.attribute`` for what its classes define."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(target.id for target in targets if isinstance(target, ast.Name))
        if isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(f"{node.name}.{member.name}")
                elif isinstance(member, ast.AnnAssign) and isinstance(member.target, ast.Name):
                    names.add(f"{node.name}.{member.target.id}")
    return names


def test_every_cited_file_and_folder_exists() -> None:
    assert CITED_FILES and CITED_FOLDERS
    assert [cited for cited in [*CITED_FILES, *CITED_FOLDERS] if not (REPO / cited).exists()] == []


def test_every_name_the_page_gives_is_defined_in_a_file_it_cites() -> None:
    defined = set().union(*(defined_in(REPO / cited) for cited in CITED_FILES if (REPO / cited).exists()))
    packages = {path.name for path in REPO.iterdir() if (path / "__init__.py").exists()}
    code = [name for name in NAMED if name not in NOT_OURS | packages and not name.startswith("cache_config_")]
    assert len(code) > 40
    assert [name for name in code if name not in defined] == []
