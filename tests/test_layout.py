"""The monorepo's shape: every package is a complete distribution and dependencies point one way."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent for p in (ROOT / "packages").glob("*/pyproject.toml"))
CORES = [p for p in PACKAGES if p.name.startswith("ts-")]


def _project(path: pathlib.Path) -> dict:
    return tomllib.loads((path / "pyproject.toml").read_text())


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_package_is_a_complete_distribution(package):
    project = _project(package)
    import_name = package.name.replace("-", "_")
    assert project["project"]["name"] == package.name
    assert (package / "README.md").is_file()
    assert (package / "tests").is_dir() and list((package / "tests").glob("test_*.py"))
    init = package / "src" / import_name / "__init__.py"
    assert init.is_file()
    assert "__all__" in init.read_text()
    assert project["build-system"]["build-backend"] == "scikit_build_core.build"


@pytest.mark.parametrize("package", CORES, ids=lambda p: p.name)
def test_core_ships_native_sources_in_its_sdist(package):
    project = _project(package)
    skbuild = project["tool"]["scikit-build"]
    assert skbuild["sdist"]["force-include"] == {"../../native": "native"}
    cmake = (package / "CMakeLists.txt").read_text()
    assert "native/cmake/TrainStreamCore.cmake" in cmake and "ts_add_core(" in cmake
    assert "nanobind" in " ".join(project["build-system"]["requires"])


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_public_modules_declare_all(package):
    src = package / "src" / package.name.replace("-", "_")
    for module in src.glob("*.py"):
        if module.name.startswith("_") and module.name != "__init__.py":
            continue
        tree = ast.parse(module.read_text())
        names = {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets
                 if isinstance(t, ast.Name)}
        assert "__all__" in names, f"{module.relative_to(ROOT)} has no __all__"


@pytest.mark.parametrize("core", ["ts_pinned", "ts_adamw", "ts_quant", "ts_planner"])
def test_cores_do_not_import_each_other(core):
    """A user who installs one core gets only that core: importing it loads no sibling."""
    others = {"ts_pinned", "ts_adamw", "ts_quant", "ts_kvcache", "ts_peer", "ts_planner", "trainstream"} - {core}
    code = f"import sys, {core}; print(sorted(m for m in {sorted(others)!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_trainstream_declares_the_cores_it_imports():
    declared = {d.split("==")[0].split(">")[0].strip() for d in _project(ROOT / "packages/trainstream")["project"]["dependencies"]}
    src = ROOT / "packages/trainstream/src/trainstream"
    imported = set()
    for module in src.rglob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module.split(".")[0])
    cores = {name for name in imported if name.startswith("ts_")}
    assert {c.replace("_", "-") for c in cores} <= declared


def test_no_source_file_is_too_long():
    long = []
    for path in [*ROOT.glob("packages/*/src/**/*.py"), *ROOT.glob("packages/*/csrc/*"), *ROOT.glob("native/**/*.*")]:
        if path.suffix in {".py", ".cpp", ".cu", ".h", ".cuh"} and len(path.read_text().splitlines()) > 600:
            long.append(str(path.relative_to(ROOT)))
    assert not long, f"files over 600 lines: {long}"


def _trainstream_import_graph() -> dict[str, set[tuple[str, str]]]:
    """trainstream's modules and subpackages (top-level units: `engine`, `planning`, `_wrap`, ...) -> the units
    they import, with where, counting imports inside functions too. The package's ``__init__`` is the facade
    that composes everything; calling the public API through it is not an edge."""
    root = ROOT / "packages" / "trainstream" / "src" / "trainstream"
    edges: dict[str, set[tuple[str, str]]] = {}
    for path in root.rglob("*.py"):
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        unit = module.split(".")[1] if "." in module else None
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join([*base, node.module]) if node.module else ".".join(base)
                names = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == "trainstream" and len(parts) > 1 and unit is not None and parts[1] != unit:
                    edges.setdefault(unit, set()).add((parts[1], f"{path.relative_to(root)}:{node.lineno}"))
    return edges


def test_trainstream_has_no_import_cycle():
    edges = _trainstream_import_graph()
    graph = {unit: {target for target, _ in targets} for unit, targets in edges.items()}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            unit = todo.pop()
            if unit == goal:
                return True
            if unit not in seen:
                seen.add(unit)
                todo.extend(graph.get(unit, ()))
        return False

    cycles = sorted(f"{unit} -> {target} ({where}), and back" for unit, targets in edges.items()
                    for target, where in targets if reaches(target, unit))
    assert not cycles, "import cycles between trainstream's modules:\n" + "\n".join(cycles)


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_package_ships_its_typing_marker(package):
    """py.typed (PEP 561) beside __init__.py, and in the installed package, so type checkers read the signatures."""
    import importlib.resources

    import_name = package.name.replace("-", "_")
    assert (package / "src" / import_name / "py.typed").is_file()
    assert importlib.resources.files(import_name).joinpath("py.typed").is_file()
