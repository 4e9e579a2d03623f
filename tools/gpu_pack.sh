#!/usr/bin/env bash
# The device tool returns at most 8 files from $OUT (16 MiB each): run this last in a device command to
# pack everything under $OUT into $OUT/results.tar, leaving beside it only the files named here (a
# summary to read at once, the wheels.tar to carry to the next call).
#
#   bash tools/gpu_run.sh -m cuda > $OUT/run.log 2>&1; python3 tools/bench/x.py --json $OUT/x.json; bash tools/gpu_pack.sh run.log wheels.tar
#
# Unpack here with: tar xf /work/.device/N/results.tar -C somewhere
set -uo pipefail
OUT=${OUT:-results}
cd "$OUT" || exit 1
keep=("$@")
pack=()
for f in *; do
  [[ "$f" == results.tar ]] && continue
  skip=""
  for k in "${keep[@]}"; do [[ "$f" == "$k" ]] && skip=1; done
  [[ -z "$skip" ]] && pack+=("$f")
done
if [[ ${#pack[@]} -gt 0 ]]; then
  tar cf results.tar "${pack[@]}" && rm -rf "${pack[@]}"
fi
ls -la
