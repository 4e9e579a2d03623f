#!/usr/bin/env bash
# JIT-builds, once per machine, what the external engines of tools/bench/compare.py compile on first use:
# DeepSpeed's CPU Adam (about a minute) and the reference 0.4.1's CUDA extension (a few minutes), so no
# engine run pays for it. Needs the carried wheels installed as tools/gpu_env.sh installs them (/tmp/site,
# /tmp/ref-site); can run in the background beside the tests of tools/gpu_run.sh.
#
#   tools/gpu_jit.sh [deepspeed] [reference]     # default: both
set -uo pipefail
export CXX=/usr/bin/g++ CC=/usr/bin/gcc CUDAHOSTCXX=/usr/bin/g++
status=0
for what in ${*:-deepspeed reference}; do
  [ -f "/tmp/.ts-jit-$what" ] && continue
  case $what in
    deepspeed) timeout 400 env PYTHONPATH=/tmp/site python3 -c \
                 'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(); print("DeepSpeed CPU Adam built")' ;;
    reference) timeout 400 env PYTHONPATH=/tmp/ref-site python3 -c 'import trainstream; print("reference", trainstream.__file__)' ;;
    *) echo "unknown: $what (deepspeed, reference)"; false ;;
  esac && touch "/tmp/.ts-jit-$what" || { echo "$what: build failed"; status=1; }
done
exit $status
