#!/usr/bin/env bash
# Session 3, final GPU call c: prefetcher benchmark (with this session's code), staging chunk sizes,
# reliability report.
set -u
R=$OUT/r; mkdir -p "$R"
timeout 120 python3 benchmarks/bench_prefetcher.py --out "$R" > "$R/bench-prefetcher.log" 2>&1
grep "gpufeed\|pin_non\|ceiling:" "$R/bench-prefetcher.log" | grep -v "|" | head -12
for c in 16 8; do
  timeout 45 python3 benchmarks/bench_prefetcher.py --methods gpufeed --chunk-mib $c --out "$R/chunk$c" \
    > "$R/chunk$c.log" 2>&1; grep "gpufeed \|ceiling:" "$R/chunk$c.log" | grep -v "|"
done
timeout 170 python3 tests/reliability/report.py --runs 1 > "$R/report.log" 2>&1; tail -2 "$R/report.log"
cp docs/reliability.md tests/reliability/last_run_0.* "$R/"
tar -C "$OUT" -cf "$OUT/r.tar" r && rm -rf "$R"
