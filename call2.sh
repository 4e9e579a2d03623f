set -x
bash tools/gpu_run.sh -T -w .whl/wheels.tar ts-pinned ts-adamw ts-quant ts-kvcache ts-peer ts-planner trainstream > $OUT/build.log 2>&1
(cd packages/ts-kvcache/bench && timeout 150 python3 generate.py --engine paged --vram-cap-gb 18 --batch 128 --prompt 512 --new 8 --prefill-chunk 64 --slots 3 --profile 16 --py-profile 16 > $OUT/kv-profile.log 2>&1; tail -c 1200 $OUT/kv-profile.log)
timeout 190 python3 tools/bench/plan_accuracy.py --scenario full7b --timeout 180 --json $OUT/plan-full7b.json > $OUT/plan-full7b.log 2>&1; tail -5 $OUT/plan-full7b.log
timeout 200 python3 tools/bench/plan_accuracy.py --scenario lora32b --timeout 190 --json $OUT/plan-lora32b.json > $OUT/plan-lora32b.log 2>&1; tail -5 $OUT/plan-lora32b.log
