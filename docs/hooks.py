"""MkDocs hooks of the documentation site (mkdocs.yml: ``hooks``).

The pages are the Markdown files GitHub shows, so their links are written for GitHub: relative to the file, and
some leave docs/ (the README, the changelog, the packages' READMEs). Here:

- A line ``<!-- include: PATH -->`` (PATH from the repository root) is replaced by that file, its links rebased
  onto the page: docs/index.md is the README, docs/changelog.md the changelog, each docs/reference page its
  package's README.
- A link to a repository file outside docs/ that the site presents as a page (``REPO_PAGES``) points to that
  page; any other link out of docs/ is left as it is, so mkdocs --strict reports it.
- The option tables of options.md are rendered from the code at build time (the generator of
  packages/trainstream/tests/test_options_docs.py), so the site shows a field added to ``trainstream.Config`` even
  before the committed page is regenerated (that test fails until it is).
"""

from __future__ import annotations

import importlib.util
import posixpath
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())

# Repository paths (outside docs/) -> the docs page that presents them.
REPO_PAGES = {
    "README.md": "index.md",
    "CHANGELOG.md": "changelog.md",
    **{f"packages/{name}": f"reference/{name}.md" for name in _PACKAGES},
    **{f"packages/{name}/README.md": f"reference/{name}.md" for name in _PACKAGES},
}

_INCLUDE = re.compile(r"^<!-- include: (\S+) -->[ \t]*$", re.M)
# Fenced blocks and code spans hold no links; the alternation skips them.
_LINK_OR_CODE = re.compile(r"(^(```|~~~).*?^\2)|(``[^\n]*?``|`[^`\n]*`)|(\]\()([^)\s]+)(\))", re.M | re.S)
_SCHEME = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*:")


def rebase(markdown: str, source_dir: str, page_uri: str) -> str:
    """Rewrites the relative links of ``markdown``, written relative to the repository folder ``source_dir``, for
    the page at ``page_uri`` (relative to docs/)."""
    page_dir = posixpath.dirname(page_uri)

    def target(link: str) -> str:
        if _SCHEME.match(link) or link.startswith(("#", "/")):
            return link
        path, hash_, fragment = link.partition("#")
        repo_path = posixpath.normpath(posixpath.join(source_dir, path))
        if repo_path.startswith("docs/"):
            docs_path = repo_path.removeprefix("docs/")
        elif repo_path in REPO_PAGES:
            docs_path = REPO_PAGES[repo_path]
        elif source_dir == posixpath.join("docs", page_dir).rstrip("/"):
            return link  # the page's own link, out of docs/ and not a page: mkdocs reports it
        else:
            docs_path = posixpath.relpath(repo_path, "docs")
        return posixpath.relpath(docs_path, page_dir or ".") + hash_ + fragment

    def replace(match: re.Match) -> str:
        if match.group(4) is None:
            return match.group(0)
        return match.group(4) + target(match.group(5)) + match.group(6)

    return _LINK_OR_CODE.sub(replace, markdown)


def _include(match: re.Match, page_uri: str) -> str:
    path = match.group(1)
    text = (ROOT / path).read_text(encoding="utf-8")
    return rebase(text, posixpath.dirname(path), page_uri)


def _options_generator():
    path = ROOT / "packages" / "trainstream" / "tests" / "test_options_docs.py"
    spec = importlib.util.spec_from_file_location("_options_docs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _current_options(markdown: str) -> str:
    generator = _options_generator()
    old = generator.section(markdown)
    if not old:
        raise ValueError(f"docs/options.md lacks its generated section ({generator.BEGIN})")
    return markdown.replace(old, generator.render())


def on_page_markdown(markdown: str, page, config, files) -> str:
    uri = page.file.src_uri
    if uri == "options.md":
        markdown = _current_options(markdown)
    markdown = _INCLUDE.sub(lambda m: _include(m, uri), markdown)
    return rebase(markdown, posixpath.join("docs", posixpath.dirname(uri)).rstrip("/"), uri)
