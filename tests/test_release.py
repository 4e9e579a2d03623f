"""One release: the seven distributions share one version, read from one place each, and pin each other exactly.

The version of a package lives only in its ``__init__.py`` (``__version__``); its pyproject.toml declares the
version dynamic and has scikit-build-core's regex provider read it from there, so the wheel, the sdist and
``import`` cannot disagree. trainstream (and ts-kvcache, which uses ts-pinned) pins the cores it needs to
exactly that version: a namesake on a public index (docs/development.md#releases) can never satisfy the pin
by a looser range. The `dists` nox session installs the built wheels into a fresh virtualenv and checks the same
version comes out of ``import`` and ``trainstream --version``.
"""

from __future__ import annotations

import ast
import importlib.resources
import pathlib
import re

import pytest
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent for p in (ROOT / "packages").glob("*/pyproject.toml"))
NAMES = [p.name for p in PACKAGES]
CORES = [n for n in NAMES if n.startswith("ts-")]


def _project(package: pathlib.Path) -> dict:
    return tomllib.loads((package / "pyproject.toml").read_text())


def _init(package: pathlib.Path) -> pathlib.Path:
    return package / "src" / package.name.replace("-", "_") / "__init__.py"


def _source_version(package: pathlib.Path) -> str:
    """``__version__`` as the module assigns it (a string literal: the regex provider reads only that)."""
    tree = ast.parse(_init(package).read_text())
    found = [node.value.value for node in tree.body if isinstance(node, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)
             and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)]
    assert len(found) == 1, f"{_init(package).relative_to(ROOT)}: expected one __version__ = '...' string literal"
    return found[0]


def _pins(package: pathlib.Path) -> dict[str, str]:
    """The ts-* / trainstream requirements of a package: name -> the requirement's specifier text."""
    pins = {}
    for requirement in _project(package)["project"].get("dependencies", []):
        match = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*(.*)", requirement)
        assert match, requirement
        name, spec = match.group(1).lower().replace("_", "-"), match.group(2).strip()
        if name in NAMES:
            pins[name] = spec
    return pins


VERSION = _source_version(ROOT / "packages" / "trainstream")


def test_all_seven_are_here():
    assert sorted(NAMES) == sorted(["trainstream", "ts-pinned", "ts-adamw", "ts-quant", "ts-kvcache", "ts-peer",
                                    "ts-planner"])


def test_the_seven_versions_agree():
    versions = {p.name: _source_version(p) for p in PACKAGES}
    assert len(set(versions.values())) == 1, f"the packages disagree on their version: {versions}"
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION), VERSION


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_the_version_has_one_source(package):
    """pyproject.toml names no version of its own: scikit-build-core reads __version__ from __init__.py."""
    project = _project(package)
    assert "version" not in project["project"], f"{package.name}: a static version beside __version__"
    assert "version" in project["project"].get("dynamic", [])
    provider = project["tool"]["scikit-build"]["metadata"]["version"]
    assert provider["provider"] == "scikit_build_core.metadata.regex"
    assert (package / provider["input"]).resolve() == _init(package).resolve()
    assert "regex" not in provider, "the provider's default regex reads `__version__ = \"X\"`; keep it"


def test_trainstream_pins_every_core_exactly():
    pins = _pins(ROOT / "packages" / "trainstream")
    assert sorted(pins) == sorted(CORES), f"trainstream's ts-* dependencies: {sorted(pins)}"
    loose = {name: spec for name, spec in pins.items() if spec != f"=={VERSION}"}
    assert not loose, f"trainstream must pin each core to =={VERSION}: {loose}"


@pytest.mark.parametrize("package", [p for p in PACKAGES if p.name != "trainstream"], ids=lambda p: p.name)
def test_a_core_that_needs_a_core_pins_it_exactly(package):
    loose = {name: spec for name, spec in _pins(package).items() if spec != f"=={VERSION}"}
    assert not loose, f"{package.name} must pin its ts-* dependencies to =={VERSION}: {loose}"


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_each_package_ships_py_typed(package):
    import_name = package.name.replace("-", "_")
    assert (package / "src" / import_name / "py.typed").is_file(), f"{package.name} lacks py.typed"
    assert importlib.resources.files(import_name).joinpath("py.typed").is_file(), \
        f"the installed {import_name} lacks py.typed (is it installed from packages/{package.name}?)"


def test_the_installed_distributions_are_this_version():
    """What `trainstream --version` prints: each distribution's metadata, which must be this tree's version
    (a stale install says so here: reinstall the packages)."""
    from trainstream._versions import installed_versions

    lines = installed_versions().splitlines()
    expected = [f"{name} {VERSION}" for name in ("trainstream", "ts-pinned", "ts-adamw", "ts-quant", "ts-planner",
                                                 "ts-kvcache", "ts-peer")]
    assert lines[:-1] == expected
    assert lines[-1].startswith("torch ")
