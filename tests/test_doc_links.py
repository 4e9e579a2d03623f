"""Every relative link in the README, docs/*.md (the lab notebook in docs/results/ and the site's docs/reference/
pages included) and the packages' READMEs resolves: the file (or folder) exists relative to the page, and a
`#fragment` into a Markdown page names one of its headings (GitHub's anchors). `mkdocs build --strict` (`nox -s
docs`) checks the built site's links the same way."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("**/*.md"), *(ROOT / "packages").glob("*/README.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: its text (links and code marks dropped), lowercased, punctuation removed
    (hyphens and underscores kept), spaces made hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", text))


def anchors(page: pathlib.Path) -> set[str]:
    out: set[str] = set()
    seen: dict[str, int] = {}
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        base = _anchor(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: pathlib.Path) -> list[str]:
    text = FENCE.sub("", page.read_text())  # code blocks hold no links
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: {dest.name} has no heading with that anchor")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page):
    assert not broken_links(page), broken_links(page)


def test_the_pages_are_found():
    names = {str(p.relative_to(ROOT)) for p in PAGES}
    assert {"README.md", "docs/options.md", "docs/guarantees.md", "packages/ts-quant/README.md",
            "docs/results/notebook-before-harness.md"} <= names


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "there.md").write_text("# A heading\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md#a-heading) [gone](missing.md) [bad](there.md#nope) [web](https://x.org/y)\n"
                    "```\n[in code](not-a-link.md)\n```\n")
    assert broken_links(page) == ["missing.md: no such file", "there.md#nope: there.md has no heading with that anchor"]
