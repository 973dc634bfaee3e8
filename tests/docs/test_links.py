"""Every relative link of the README and of docs/ leads somewhere: its file or folder exists, and its anchor is a
heading of that page (as GitHub makes anchors of headings) or an explicit ``<a id>``/``<a name>`` there."""

from __future__ import annotations

import re
import urllib.parse
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = ["README.md", *sorted(f"docs/{page.name}" for page in (REPO / "docs").glob("*.md"))]
# Pages other changes are writing, linked before they land: a link to one of them may not resolve yet, and has no
# anchor. Once a page exists, its links are checked like every other page's.
PENDING = {"docs/schedulers.md"}

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[ \t]*$", flags=re.DOTALL | re.MULTILINE)
CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", flags=re.DOTALL)
# [text](target) and ![alt](target), with an optional title; <target> may hold spaces.
INLINE = re.compile(r"!?\[(?:[^\[\]\\]|\\.|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)", flags=re.MULTILINE)
HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.*?)[ \t]*#*[ \t]*$", flags=re.MULTILINE)
EXPLICIT = re.compile(r"<a\s[^>]*\b(?:id|name)=\"([^\"]+)\"", flags=re.IGNORECASE)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//")


def prose(markdown: str) -> str:
    """The page without its code blocks and code spans, where brackets are no links."""
    return CODE_SPAN.sub("", FENCE.sub("", markdown))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text, lower-cased, without punctuation, spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every anchor of a page: its headings' (the second of a name ``-1``, and so on) and its explicit ones."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in HEADING.findall(FENCE.sub("", markdown)):
        name = slug(heading)
        if name in seen:
            seen[name] += 1
            found.add(f"{name}-{seen[name]}")
        else:
            seen[name] = 0
            found.add(name)
    return found | set(EXPLICIT.findall(markdown))


def links(markdown: str) -> list[str]:
    text = prose(markdown)
    return [target.strip("<>") for target in INLINE.findall(text) + REFERENCE.findall(text)]


def test_the_slugs_are_githubs() -> None:
    assert slug("Fleets: replicas, heartbeats and expiry") == "fleets-replicas-heartbeats-and-expiry"
    assert slug("Joining vLLM's own series") == "joining-vllms-own-series"
    assert slug("Protecting /metrics and the JSON state") == "protecting-metrics-and-the-json-state"
    assert slug("`cache_config_info` and the [true](x.md) sizes") == "cache_config_info-and-the-true-sizes"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n### A\n") == {"a", "a-1", "a-2"}


def test_links_are_found_outside_code_only() -> None:
    page = '[a](a.md) ![b](b.png "title")\n[c]: <c d.md>\n`[e](e.md)`\n```\n[f](f.md)\n```\n[g](<g h.md#x>)\n'
    assert sorted(links(page)) == ["a.md", "b.png", "c d.md", "g h.md#x"]


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_and_anchor_resolves(page: str) -> None:
    source = REPO / page
    broken = []
    for target in links(source.read_text()):
        if SCHEME.match(target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (source.parent / urllib.parse.unquote(path)).resolve() if path else source
        name = resolved.relative_to(REPO).as_posix() if resolved.is_relative_to(REPO) else str(resolved)
        if not resolved.exists():
            if name in PENDING and not anchor:
                continue
            broken.append(f"{target}: no {name}")
        elif anchor and resolved.suffix == ".md" and urllib.parse.unquote(anchor) not in anchors(resolved.read_text()):
            broken.append(f"{target}: no heading or anchor #{anchor} in {name}")
    assert not broken, f"{page}:\n" + "\n".join(broken)
