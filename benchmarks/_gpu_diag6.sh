#!/usr/bin/env bash
# Session 3, GPU call 6: small work inline on the background thread: cuda tests, nanoTabPFN, CLI bench, touch.
set -u
R=$OUT/r; mkdir -p "$R"
timeout 200 python3 -m pytest -m cuda tests -q -p no:cacheprovider -rs > "$R/cuda-tests.log" 2>&1
tail -3 "$R/cuda-tests.log"
timeout 40 python3 benchmarks/_diag_touch.py 2>&1 | tee "$R/touch.log"
(cd /tmp && timeout 120 python3 -m gpufeed.cli bench --out "$R/cli-bench" > "$R/cli-bench.log" 2>&1)
tail -9 "$R/cli-bench.log"
timeout 230 python3 benchmarks/bench_tabpfn.py --out "$R" > "$R/bench-tabpfn.log" 2>&1
grep "^| \(ideal\|orig\|gpufeed\)" "$R"/tabpfn-*.md | cut -c1-120
tar -C "$OUT" -cf "$OUT/r.tar" r && rm -rf "$R"
