#!/usr/bin/env bash
# Runs on the GPU machine (torch preinstalled, no network): builds the chosen
# packages with CUDA, runs their GPU-marked tests (plus the CPU ones), and
# optional benchmarks. Logs and JSON land in $OUT (or ./results).
#
#   tools/gpu_run.sh [-b "pinned adamw quant"] [-a "bench args"] [-k PYTEST_EXPR] [-m MARKERS] [-w DIR] [-T] [package ...]
#
# Packages default to every one under packages/. The device tool's call is e.g.
#   bash tools/gpu_run.sh -b "pinned adamw" ts-pinned ts-adamw
# -w DIR: reuse the wheels in DIR (e.g. a carried .whl/gpu, or a wheels.tar an earlier call returned) of
#   every core whose sources are unchanged (each wheel has a DIR/<name>.sources hash beside it); the cores
#   built here are saved with their hashes in $OUT/wheels.tar, to carry to the next call (building every
#   core takes ~110 s on the H200). Build logs go to $OUT/build-logs.tar: the device tool returns at
#   most 8 files.
# -T: build and install only, no tests.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}
mkdir -p "$OUT"
benches="" bench_args="" select="" markers="" wheels="" no_tests=""
while getopts "b:a:k:m:w:T" opt; do
  case $opt in
    b) benches=$OPTARG ;;
    a) bench_args=$OPTARG ;;
    k) select=$OPTARG ;;
    m) markers=$OPTARG ;;
    w) wheels=$OPTARG ;;
    T) no_tests=1 ;;
    *) echo "usage: $0 [-b benches] [-a bench-args] [-k expr] [-m markers] [-w wheel-dir] [-T] [package ...]"; exit 2 ;;
  esac
done
# A core's sources (build outputs excluded), as one hash: a carried wheel is reused only when it matches.
sources_hash() { (cd "$1" && find . -type f -not -path './build/*' -not -name '*.pyc' -not -path '*/__pycache__/*' \
                  -print0 | LC_ALL=C sort -z | xargs -0 sha1sum | sha1sum | cut -c1-40); }
shift $((OPTIND - 1))
if [[ "$wheels" == *.tar ]]; then  # unpack a returned wheels.tar beside itself, under /tmp
  mkdir -p /tmp/carried-wheels && tar xf "$wheels" -C /tmp/carried-wheels && wheels=/tmp/carried-wheels/wheels
fi
order="ts-pinned ts-adamw ts-quant ts-kvcache ts-peer ts-planner trainstream"
wanted=${*:-$order}
# The GPU image's default compiler (/opt/gcc/bin/g++) links libstdc++ statically;
# C++ exceptions thrown while a core has released the GIL then crash the process
# beside torch's dynamic libstdc++ (seen on the H200 image, 2026-11-30). The
# system compiler links it dynamically and works. CXX unset lets CMake take the c++ first on PATH, which
# may be that one: the system compiler is named then too.
if [[ ( -z "${CXX:-}" || "${CXX:-}" == /opt/gcc/* ) && -x /usr/bin/g++ ]]; then
  export CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ CC=/usr/bin/gcc
fi
export TS_ENABLE_CUDA=ON TS_CUDA_ARCHITECTURES=${TS_CUDA_ARCHITECTURES:-90} PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g | head -2;
  python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)'; } | tee "$OUT/machine.txt"

status=0
install=()
for p in $order; do
  [ -f "packages/$p/pyproject.toml" ] || continue
  case " $wanted " in *" $p "*) install+=("packages/$p") ;; esac
  # trainstream needs its dependencies installed too
  if [[ " $wanted " == *" trainstream "* && " ts-pinned ts-adamw ts-quant ts-planner ts-kvcache ts-peer " == *" $p "* ]]; then
    [[ " ${install[*]} " == *" packages/$p "* ]] || install+=("packages/$p")
  fi
done
tests=()
mkdir -p "$OUT/wheels"
for dir in "${install[@]}"; do
  start=$(date +%s)
  name=$(basename "$dir")
  hash=$(sources_hash "$dir")
  carried=""
  if [[ -n "$wheels" && "$name" != trainstream && -f "$wheels/$name.sources" && "$(cat "$wheels/$name.sources")" == "$hash" ]]; then
    carried=$(ls "$wheels"/"${name//-/_}"-*.whl 2>/dev/null | head -1)
  fi
  if [[ -n "$carried" ]]; then
    ok=$(python3 -m pip install -q --no-deps --force-reinstall "$carried" > "$OUT/build-$name.log" 2>&1 && echo 1)
    cp "$carried" "$wheels/$name.sources" "$OUT/wheels/"  # the returned archive stays complete
    what="installed the carried wheel of"
  elif [[ "$name" == trainstream ]]; then  # pure Python: nothing to carry
    ok=$(python3 -m pip install -q --no-build-isolation --no-deps "$dir" > "$OUT/build-$name.log" 2>&1 && echo 1)
    what="installed"
  else
    ok=$(python3 -m pip wheel -q --no-build-isolation --no-deps -w "$OUT/wheels" "$dir" > "$OUT/build-$name.log" 2>&1 \
         && python3 -m pip install -q --no-deps --force-reinstall "$OUT"/wheels/"${name//-/_}"-*.whl >> "$OUT/build-$name.log" 2>&1 \
         && echo 1)
    [[ -n "$ok" ]] && echo "$hash" > "$OUT/wheels/$name.sources"
    what="built"
  fi
  if [[ -n "$ok" ]]; then
    echo "$what $name in $(( $(date +%s) - start )) s"
    [ -d "$dir/tests" ] && tests+=("$dir/tests")
  else
    echo "BUILD FAILED: $name"; tail -30 "$OUT/build-$name.log"; status=1
  fi
done
# Few files come back from the device: the wheels and the logs travel as one archive each.
tar cf "$OUT/wheels.tar" -C "$OUT" wheels && rm -rf "$OUT/wheels"
tar cf "$OUT/build-logs.tar" -C "$OUT" $(cd "$OUT" && ls build-*.log) && rm -f "$OUT"/build-*.log
[[ -n "$no_tests" ]] && exit $status

python3 -m pytest -q -p no:cacheprovider ${select:+-k "$select"} ${markers:+-m "$markers"} "${tests[@]}" tests 2>&1 | tee "$OUT/tests.log" | tail -40
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

for b in $benches; do
  echo "== bench $b"
  python3 "tools/bench/$b.py" --json "$OUT/bench-$b.json" $bench_args 2>&1 | tee "$OUT/bench-$b.log" | tail -40
done
exit $status
