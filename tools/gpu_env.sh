# Sourced at the start of a device command: makes the GPU machine ready for tools/bench/compare.py whether or
# not an earlier call on the same warm machine already did (each step is skipped when its result is there).
#
#   source tools/gpu_env.sh [COMMIT]    # COMMIT stamps the records (a snapshot has no git of its own)
#   TS_GPU_JIT="deepspeed" source tools/gpu_env.sh ...   # JIT-build only what the engines run need ("": none)
#
# - the cores and trainstream: installed from the carried .whl/gpu/wheels.tar where their sources match,
#   else built (tools/gpu_run.sh -T);
# - the carried external engines (tools/bench/fetch_external.sh): bitsandbytes in /tmp/bnb, DeepSpeed and its
#   dependencies in /tmp/site, the reference 0.4.1 in /tmp/ref-site;
# - DeepSpeed's CPU Adam and the reference's CUDA extension JIT-built once (tools/gpu_jit.sh; TS_GPU_JIT picks).
# Exports GPU_NAME (h100 or h200) for the records' file names.
export PYTHONUNBUFFERED=1 CXX=/usr/bin/g++ CC=/usr/bin/gcc CUDAHOSTCXX=/usr/bin/g++
export TS_BENCH_REFERENCE_PREFIX=/tmp/ref-site
[ -n "${1:-}" ] && export TS_BENCH_COMMIT=$1 TS_BENCH_DIRTY=0
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -qi h200 && echo h200 || echo h100)
export GPU_NAME
_ts_out=${OUT:-results}
mkdir -p "$_ts_out"
if ! python3 -c 'import ts_adamw, ts_planner, trainstream' 2>/dev/null; then
  bash tools/gpu_run.sh -T -w .whl/gpu/wheels.tar > "$_ts_out/env-build.log" 2>&1 || tail -20 "$_ts_out/env-build.log"
fi
_ts_pip() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$@"; }
[ -d /tmp/bnb ] || _ts_pip /tmp/bnb .whl/bnb/*.whl
[ -d /tmp/site ] || _ts_pip /tmp/site .whl/bench/*.whl
[ -d /tmp/ref-site ] || _ts_pip /tmp/ref-site .whl/reference/*.whl
export PYTHONPATH=/tmp/site:/tmp/bnb
if [ -n "${TS_GPU_JIT-deepspeed reference}" ]; then
  bash tools/gpu_jit.sh ${TS_GPU_JIT-deepspeed reference} > "$_ts_out/jit.log" 2>&1 || tail -5 "$_ts_out/jit.log"
fi
unset _ts_out
