"""docs/hooks.py, the documentation site's build hooks: the option tables are rendered from the code at build
time, and links written for GitHub are rebased onto the site's pages."""

from __future__ import annotations

import importlib.util
import pathlib
import types

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(path: pathlib.Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hooks = _load(ROOT / "docs" / "hooks.py", "_site_hooks")
generator = _load(ROOT / "packages" / "trainstream" / "tests" / "test_options_docs.py", "_options_docs")


def _page(uri: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(file=types.SimpleNamespace(src_uri=uri))


def test_the_site_renders_the_option_tables_from_the_code():
    """A page whose generated section is stale (here: empty) is built with a row for every option."""
    stale = f"# Options\n\n{generator.BEGIN}\n\n{generator.END}\n\nAfter.\n"
    built = hooks.on_page_markdown(stale, _page("options.md"), None, None)
    assert generator.missing_rows(built) == []
    assert generator.section(built) == generator.render()
    assert built.endswith("\n\nAfter.\n")
    # Other pages keep a section that looks generated as it is.
    assert generator.section(hooks.on_page_markdown(stale, _page("planning.md"), None, None)) == \
        f"{generator.BEGIN}\n\n{generator.END}"


def test_links_leaving_docs_point_to_the_pages_that_present_them():
    text = "[readme](../README.md) [core](../packages/ts-quant/README.md#nf4) [guide](planning.md) `[x](../y.md)`"
    rebased = hooks.rebase(text, "docs", "guides/page.md")  # a file of docs/ shown as guides/page
    assert "[readme](../index.md)" in rebased
    assert "[core](../reference/ts-quant.md#nf4)" in rebased
    assert "[guide](../planning.md)" in rebased
    assert "`[x](../y.md)`" in rebased  # code spans hold no links
