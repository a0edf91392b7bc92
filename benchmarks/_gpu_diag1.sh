#!/usr/bin/env bash
# Session 3, GPU call 1: staging threads (issue 2), small source batches (issue 4), reliability (issue 6).
set -u
R=$OUT/r; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$R/gpu.txt"; nproc >> "$R/gpu.txt"
timeout 110 python3 benchmarks/bench_prefetcher.py --out "$R/pf-default" > "$R/pf-default.log" 2>&1
for n in 8 12 4; do
  GPUFEED_STAGE_THREADS=$n timeout 45 python3 benchmarks/bench_prefetcher.py --methods gpufeed \
    --out "$R/pf-t$n" > "$R/pf-t$n.log" 2>&1
done
grep -h "gpufeed\|pin_non\|ceiling:" "$R"/pf-*.log | grep -v "|" | head -40
timeout 120 python3 benchmarks/_diag_small.py --out "$R/small" > "$R/small.log" 2>&1; cat "$R/small.log"
timeout 170 python3 tests/reliability/report.py --runs 1 > "$R/report.log" 2>&1; tail -3 "$R/report.log"
cp docs/reliability.md tests/reliability/last_run_0.* "$R/"
for i in 1 2; do
  timeout 60 python3 -m pytest tests/reliability/test_rel_faults.py -q -p no:cacheprovider -x \
    > "$R/faults-$i.log" 2>&1; tail -2 "$R/faults-$i.log"
done
tar -C "$OUT" -cf "$OUT/r.tar" r && rm -rf "$R"
