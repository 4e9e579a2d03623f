bash tools/gpu_run.sh -T -w .whl/wheels.tar ts-pinned ts-adamw ts-quant ts-kvcache ts-peer ts-planner trainstream > $OUT/build.log 2>&1
cd packages/ts-kvcache/bench
G="--prompt 512 --new 512 --prefill-chunk 64 --slots 3 --sdpa flash efficient"
run() { t=$1; shift; echo "# $*" >> $OUT/kv.log; timeout $t python3 generate.py "$@" $G 2>&1 | grep -E "RESULT|Error" >> $OUT/kv.log; tail -1 $OUT/kv.log | cut -c1-200; }
run 120 --engine paged --batch 128 --vram-cap-gb 18
run 120 --engine offloaded --batch 128 --vram-cap-gb 18
run 80 --engine dynamic --batch 128
run 80 --engine dynamic --batch 32 --vram-cap-gb 18
run 80 --engine paged --batch 32 --vram-cap-gb 18
