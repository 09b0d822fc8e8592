#!/usr/bin/env bash
# Hardware counters of the Gluon decode kernel (kernel log 17's diagnosis step) on one GPU, one ncu process per shape:
# the details page (throughputs, pipe utilisation, warp-state stalls) and the per-SASS-instruction source page
# (where the consumer warps stall) of the second launch of each shape.
#
# Usage (repo root, on a GPU machine with Nsight Compute):  bash scripts/ncu_decode_device.sh OUTDIR [SHAPE ...]
#   SHAPE = name:H:B:L:MODE (MODE 0 real run, 2 compute-only probe); default: the H16/H128 B64 pairs and small batches.
set -u
out=${1:-out/ncu}; shift || true
mkdir -p "$out"
shapes=("$@")
[ ${#shapes[@]} -eq 0 ] && shapes=(h16_b64:16:64:8192:0 h16_b64_m2:16:64:8192:2 h128_b64:128:64:8192:0
                                    h128_b64_m2:128:64:8192:2 h16_b8:16:8:8192:0 h16_b1:16:1:32768:0)
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
for s in "${shapes[@]}"; do
  IFS=: read -r name H B L MODE <<< "$s"
  timeout ${NCU_TIMEOUT:-150} ncu --clock-control none --target-processes all -k regex:mla_decode_sm90_kernel \
      --launch-skip 1 --launch-count 1 --set full --import-source no -f -o "$out/$name" \
      python3 scripts/ncu_decode_device.py "$H" "$B" "$L" "$MODE" > "$out/$name.run.txt" 2>&1
  echo "ncu rc $?" >> "$out/$name.run.txt"
  [ -f "$out/$name.ncu-rep" ] || continue
  ncu --import "$out/$name.ncu-rep" --page details --print-units base > "$out/$name.details.txt" 2>&1
  ncu --import "$out/$name.ncu-rep" --page source --csv --print-source sass > "$out/$name.sass.csv" 2>&1 \
    || ncu --import "$out/$name.ncu-rep" --page raw --csv > "$out/$name.raw.csv" 2>&1
  grep -E "Duration|DRAM Throughput|Compute \(SM\) Throughput|Issue Slots Busy|Warp Cycles Per Issued|Registers Per" \
      "$out/$name.details.txt" | sed "s/^/$name: /"
done
