#!/usr/bin/env bash
# JIT-builds, once per machine, what the external engines of tools/bench/compare.py compile on first use:
# DeepSpeed's CPU Adam (about a minute) and the reference 0.4.1's CUDA extension (a few minutes), so no
# engine run pays for it. Needs the carried wheels installed as tools/gpu_env.sh installs them (/tmp/site,
# /tmp/ref-site); can run in the background beside the tests of tools/gpu_run.sh.
set -uo pipefail
[ -f /tmp/.ts-jit-done ] && exit 0
export CXX=/usr/bin/g++ CC=/usr/bin/gcc CUDAHOSTCXX=/usr/bin/g++
status=0
timeout 400 env PYTHONPATH=/tmp/site python3 -c \
  'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(); print("DeepSpeed CPU Adam built")' \
  || { echo "DeepSpeed CPU Adam build failed"; status=1; }
timeout 400 env PYTHONPATH=/tmp/ref-site python3 -c 'import trainstream; print("reference", trainstream.__file__)' \
  || { echo "reference build failed"; status=1; }
[ $status -eq 0 ] && touch /tmp/.ts-jit-done
exit $status
