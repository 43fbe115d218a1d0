"""Every relative Markdown link in README.md and docs/**/*.md points to a file or folder that exists, and every
#anchor into a Markdown page names one of its headings (GitHub's slugs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)  # links inside code are not links


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = CODE.sub("", page.read_text(encoding="utf-8"))
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def links(page: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(CODE.sub("", page.read_text(encoding="utf-8")))]


def test_slug_is_githubs():
    assert (
        slug("Long context — KL by position, passkey retrieval")
        == "long-context--kl-by-position-passkey-retrieval"
    )
    assert slug("`kvcal release` on every model update") == "kvcal-release-on-every-model-update"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(REPO)})")
    assert not broken, f"{page.relative_to(REPO)}: broken links: {broken}"
