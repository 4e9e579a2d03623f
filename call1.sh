set -x
bash tools/gpu_run.sh -T -w .whl/wheels.tar ts-pinned ts-adamw ts-quant ts-kvcache ts-peer ts-planner trainstream > $OUT/build.log 2>&1
cd packages/ts-kvcache/bench
timeout 200 python3 generate.py --engine paged --vram-cap-gb 18 --batch 128 --prompt 512 --new 8 --prefill-chunk 64 --slots 3 --profile 16 --py-profile 16 > $OUT/kv-profile.log 2>&1
tail -c 3000 $OUT/kv-profile.log
timeout 300 python3 generate.py --engine paged --vram-cap-gb 18 --batch 128 --prompt 512 --new 512 --prefill-chunk 64 --slots 3 > $OUT/kv-full.log 2>&1
tail -c 2000 $OUT/kv-full.log
