bash tools/gpu_run.sh -T -w .whl/wheels.tar ts-pinned ts-adamw ts-quant ts-kvcache ts-peer ts-planner trainstream > $OUT/build.log 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider packages/trainstream/tests/test_attention_cuda.py packages/ts-kvcache/tests/test_cuda.py packages/ts-kvcache/tests/test_plan.py > $OUT/tests.log 2>&1; tail -5 $OUT/tests.log
cd packages/ts-kvcache/bench
G="--prompt 512 --prefill-chunk 64 --batch 128 --vram-cap-gb 18 --sdpa flash efficient"
run() { t=$1; shift; echo "# $*" >> $OUT/kv.log; timeout $t python3 generate.py "$@" $G 2>&1 | grep -E "RESULT|Error" >> $OUT/kv.log; tail -1 $OUT/kv.log | cut -c1-300; }
run 60 --engine paged --new 8 --slots 3 --profile 24
run 75 --engine paged --new 512 --slots 2 --vram-fraction 1.0
