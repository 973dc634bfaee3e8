"""Every repository path the repository names exists: in README.md and docs/, in the comments and docstrings of
the Python code, in the CI script, pyproject.toml, the Dockerfiles and other files of docker/, and deploy/. A file
moved or renamed fails here, naming where it is still named, rather than misleading a reader."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# A path starts with one of the repository's top-level folders; it may end with ``/`` (a folder), never within a
# word (``x/exporter/...`` is some other tree's path) and never with what follows it (``.``, ``#anchor``, ``:10``);
# with a ``*`` it is a pattern, which must match a file.
TOP_LEVEL = sorted(path.name for path in REPO.iterdir() if path.is_dir() and not path.name.startswith((".", "_")))
PATH = re.compile(rf"(?<![\w./~-])((?:{'|'.join(map(re.escape, [*TOP_LEVEL, '.ci']))})/[\w./*-]*[\w/*])")
# What runs write: folders .gitignore names (``bench/results/``), whose files a command makes.
WRITTEN = tuple(
    line.strip()
    for line in (REPO / ".gitignore").read_text().splitlines()
    if not line.startswith("#") and "/" in line.strip().strip("/")
)
# Folders of this checkout that are no source: what ``pip install -e`` and the tests make.
NOT_SOURCE = {".venv", "build", "test-artifacts", ".pytest_cache", ".ruff_cache", ".git", "__pycache__"}
NOT_SOURCE |= {path.name for path in REPO.glob("*.egg-info")}
PROSE = ("README.md", "docs", ".ci/run", "pyproject.toml", "docker", "deploy")


def _files(names: tuple[str, ...] | str, suffix: str | None = None) -> list[Path]:
    found = []
    for name in (names,) if isinstance(names, str) else names:
        path = REPO / name
        candidates = [path] if path.is_file() else sorted(path.rglob("*"))
        found += [
            candidate
            for candidate in candidates
            if candidate.is_file()
            and not NOT_SOURCE & set(candidate.relative_to(REPO).parts)
            and (suffix is None or candidate.suffix == suffix)
            and candidate.suffix not in {".png", ".json", ".gz", ".msgpack", ".db", ".pyc"}
        ]
    return found


# Comments and string literals; an f-string's text is its own token from Python 3.12 on.
KEPT_TOKENS = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}


def _comments_and_docstrings(source: str) -> str:
    """A Python file's comments and string literals (its docstrings among them)."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return "\n".join(token.string for token in tokens if token.type in KEPT_TOKENS)


def exists(named: str) -> bool:
    if named.startswith(WRITTEN):
        return True
    return any(REPO.glob(named)) if "*" in named else (REPO / named).exists()


def named_paths(path: Path) -> set[str]:
    text = path.read_text(errors="replace")
    if path.suffix == ".py":
        text = _comments_and_docstrings(text)
    return {match.rstrip(".") for match in PATH.findall(text)}


SOURCES = sorted(
    {*_files(PROSE), *_files(("exporter", "protocol", "tests", "bench", "scripts"), ".py")} - {Path(__file__)}
)


@pytest.mark.parametrize("source", SOURCES, ids=lambda path: str(path.relative_to(REPO)))
def test_every_repository_path_it_names_exists(source: Path) -> None:
    missing = sorted(named for named in named_paths(source) if not exists(named))
    assert not missing, f"{source.relative_to(REPO)} names paths that do not exist: {missing}"


def test_the_paths_are_found() -> None:
    """The pattern finds paths where they are named: this file's own list is no test of it."""
    assert "exporter/cli.py" in named_paths(REPO / "docs" / "architecture.md")
    assert "tests/server/test_uvicorn_internals.py" in named_paths(REPO / "pyproject.toml")
