#!/usr/bin/env bash
# Runs on the GPU machine: the release as a user installs it, with its CUDA kernels on a real GPU.
# `nox -s dists` (here, with nvcc) leaves the release's wheels in dist/ (the cores' kernels compiled for every
# architecture of the release and repaired by auditwheel); carry that folder to the GPU machine and run
#
#   bash tools/gpu_release_check.sh [DIST]        # DIST defaults to dist/
#
# The core wheels are per Python version: the lent GPU images run Python 3.12, CI's machines 3.11. For them,
# build the cores from the same sdists with a Python 3.12 that has the build requirements and auditwheel
# (TS_ENABLE_CUDA=ON python3.12 -m build --wheel --no-isolation on each unpacked dist/ts_*.tar.gz, then
# auditwheel repair), and put trainstream's py3-none-any wheel beside them.
#
# It makes a virtualenv whose PATH holds no compiler (torch comes from the machine's site-packages: the GPU
# image's CUDA build), installs every wheel of DIST with --no-index, checks that each core says it was built
# with CUDA and was imported from the virtualenv, and runs every package's cuda-marked tests against the
# installed wheels. Logs land in $OUT (or ./results).
set -uo pipefail
cd "$(dirname "$0")/.."
dist=$(realpath "${1:-dist}")
OUT=${OUT:-results}
mkdir -p "$OUT"
venv=$(mktemp -d /tmp/ts-release-XXXX)/venv
python3 -m venv "$venv"
export CC=/bin/false CXX=/bin/false CUDACXX=/bin/false PYTHONNOUSERSITE=1
# pip runs with nothing but the venv's bin/ on PATH, so no compiler is reachable, and takes wheels only.
env PATH="$venv/bin" "$venv/bin/python" -m pip install -q --no-index --no-deps --only-binary=:all: "$dist"/*.whl \
  || { echo "the release's wheels did not install"; exit 1; }
# torch from the machine: a .pth names the site-packages it lives in (a venv made by a venv's python, as on the
# GPU images, would not see it through --system-site-packages); the venv's own packages come first on sys.path.
# Written after the install, so pip does not take a copy installed there for the release's.
python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' \
  > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/machine-torch.pth"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || true
  "$venv/bin/python" - "$venv" <<'EOF'
import importlib, sys
import torch
venv = sys.argv[1]
print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))
for name in ("ts_pinned", "ts_adamw", "ts_quant", "ts_kvcache", "ts_peer", "ts_planner", "trainstream"):
    module = importlib.import_module(name)
    assert module.__file__.startswith(venv), f"{name} imported from {module.__file__}, not the release's venv"
    if name != "trainstream":
        core = importlib.import_module(name + "._core")
        assert core.__file__.startswith(venv) and core.built_with_cuda, f"{name}: {core.__file__} lacks CUDA"
    print(name, module.__version__, "(CUDA kernels)" if name != "trainstream" else "")
EOF
} 2>&1 | tee "$OUT/release-install.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
tests=()
for p in ts-pinned ts-adamw ts-quant ts-kvcache ts-peer ts-planner; do tests+=("packages/$p/tests"); done
# The tests' directory is the repository's, the packages they import are the venv's (--import-mode=importlib).
"$venv/bin/python" -m pytest -q -p no:cacheprovider -m cuda "${tests[@]}" 2>&1 | tee "$OUT/release-tests.log" | tail -15
exit "${PIPESTATUS[0]}"
