#!/usr/bin/env bash
# Fetches what compare.py's external engines (tools/bench/_external_engines.py) need on the GPU machine
# (Python 3.12, torch 2.11+cu130, nvcc 13.0 and ninja there; no network) into the git-ignored .whl/:
#
#   .whl/bench/      deepspeed, a pure-Python wheel built here from its sdist with DS_BUILD_OPS=0 (its ops,
#                    DeepSpeedCPUAdam among them, are JIT-built there on first use, about a minute), and its
#                    runtime dependencies that the GPU image lacks (hjson, pydantic with pydantic-core,
#                    annotated-types, typing-inspection, typing-extensions) or may hold at another version
#                    (py-cpuinfo, msgpack, nvidia-ml-py, einops): cp312 manylinux wheels, no dependencies.
#                    torch, numpy, packaging, psutil, tqdm and ninja are the image's.
#   .whl/reference/  trainstream-0.4.1-py3-none-any.whl, this project's predecessor, built from its PyPI sdist
#                    (pure Python: its CUDA extension compiles on its first import there, a few minutes).
#
# Here (needs PyPI):  bash tools/bench/fetch_external.sh
#   PYTHON=... picks the interpreter that builds the wheels: it needs torch (any build; DeepSpeed's setup.py
#   imports it), setuptools>=64 and wheel. Default: .nox/tests/bin/python, else python3.
# On the device (the run carries ".whl"; the two prefixes stay apart, so the two trainstreams never meet):
#   export CXX=/usr/bin/g++ CC=/usr/bin/gcc CUDAHOSTCXX=/usr/bin/g++   # for the JIT builds, as tools/gpu_run.sh does
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/bench/*.whl && export PYTHONPATH=/tmp/site
#   python3 -m pip install -q --no-index --no-deps --target /tmp/ref-site .whl/reference/*.whl
#   export TS_BENCH_REFERENCE_PREFIX=/tmp/ref-site
#   python3 -c 'import sys; sys.path.insert(0, "/tmp/ref-site"); import trainstream'   # compile its extension once
#   python3 tools/bench/compare.py --scenario lora14b --engines deepspeed-zero3 reference-0.4.1 --timeout 1200
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-}
if [[ -z "$PY" ]]; then
  if [[ -x "$ROOT/.nox/tests/bin/python" ]]; then PY="$ROOT/.nox/tests/bin/python"; else PY=python3; fi
fi
"$PY" -c 'import torch, setuptools, wheel' || { echo "$PY needs torch, setuptools>=64 and wheel" >&2; exit 1; }

DEEPSPEED=0.19.8
REFERENCE=0.4.1
PYDANTIC=2.14.4
PYDANTIC_CORE=2.50.5  # the exact version pydantic $PYDANTIC requires (checked below)
DEPS=(
  "hjson==3.1.0" "pydantic==$PYDANTIC" "pydantic-core==$PYDANTIC_CORE" "annotated-types==0.8.0"
  "typing-inspection==0.4.5" "typing-extensions==4.16.0" "py-cpuinfo==9.0.0" "msgpack==1.2.4"
  "nvidia-ml-py==13.615.71" "einops==0.8.2"
)
BENCH="$ROOT/.whl/bench"
REF="$ROOT/.whl/reference"
SDISTS=$(mktemp -d)
trap 'rm -rf "$SDISTS"' EXIT
rm -rf "$BENCH" "$REF"
mkdir -p "$BENCH" "$REF"

pip_() { "$PY" -m pip --disable-pip-version-check "$@"; }

# DeepSpeed: setup.py needs torch, so no build isolation; DS_BUILD_OPS=0 keeps every op out of the wheel.
pip_ download -q --no-deps --no-binary :all: -d "$SDISTS" "deepspeed==$DEEPSPEED"
DS_BUILD_OPS=0 pip_ wheel -q --no-deps --no-build-isolation -w "$BENCH" "$SDISTS/deepspeed-$DEEPSPEED.tar.gz"

pip_ download -q --no-deps --only-binary :all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$BENCH" "${DEPS[@]}"

# The reference: TRAINSTREAM_PURE_WHEEL makes its setup.py skip the CUDA build even though torch is importable.
pip_ download -q --no-deps --no-binary :all: -d "$SDISTS" "trainstream==$REFERENCE"
TRAINSTREAM_PURE_WHEEL=1 pip_ wheel -q --no-deps --no-build-isolation -w "$REF" "$SDISTS/trainstream-$REFERENCE.tar.gz"

# Checks: pure-Python wheels, the pydantic pair, one version of each package.
for wheel in "$BENCH/deepspeed-$DEEPSPEED-py3-none-any.whl" "$REF/trainstream-$REFERENCE-py3-none-any.whl"; do
  [[ -f "$wheel" ]] || { echo "missing or not pure Python: $wheel" >&2; ls "$BENCH" "$REF" >&2; exit 1; }
done
"$PY" - "$BENCH" "$REF" "$PYDANTIC" "$PYDANTIC_CORE" <<'EOF'
import pathlib, sys, zipfile
bench, ref, pydantic, core = sys.argv[1:]
wheels = sorted(pathlib.Path(bench).glob("*.whl")) + sorted(pathlib.Path(ref).glob("*.whl"))
names = [w.name.split("-")[0].lower() for w in wheels]
dupes = {n for n in names if names.count(n) > 1}
assert not dupes, f"two versions of {dupes}"
(p,) = [w for w in wheels if w.name.startswith(f"pydantic-{pydantic}-")]
meta = zipfile.ZipFile(p).read(f"pydantic-{pydantic}.dist-info/METADATA").decode()
assert f"Requires-Dist: pydantic-core=={core}" in meta, "pydantic-core pin does not match pydantic's"
(r,) = [w for w in wheels if w.name.startswith("trainstream-")]
assert any(n.endswith("offload_adamw_kernel.cu") for n in zipfile.ZipFile(r).namelist()), "reference wheel lacks its csrc"
EOF

echo "fetched into .whl/ (sha256, bytes, name):"
for wheel in "$BENCH"/*.whl "$REF"/*.whl; do
  printf '%s  %9d  %s\n' "$(sha256sum "$wheel" | cut -c1-16)" "$(stat -c %s "$wheel")" "${wheel#"$ROOT"/}"
done
du -sh "$ROOT/.whl/bench" "$ROOT/.whl/reference"
