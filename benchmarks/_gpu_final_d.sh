#!/usr/bin/env bash
# Session 3, GPU call d: staging placement diagnostic; cuda tests and nanoTabPFN again with the final code.
set -u
R=$OUT/r; mkdir -p "$R"
(cd benchmarks && timeout 90 python3 _diag_affinity.py 2>&1 | tee "$R/affinity.log")
timeout 200 python3 -m pytest -m cuda tests -q -p no:cacheprovider -rs > "$R/cuda-tests.log" 2>&1
tail -2 "$R/cuda-tests.log"
timeout 230 python3 benchmarks/bench_tabpfn.py --out "$R" > "$R/bench-tabpfn.log" 2>&1
grep "^| \(ideal\|orig\|gpufeed\)" "$R"/tabpfn-*.md | cut -c1-120
tar -C "$OUT" -cf "$OUT/r.tar" r && rm -rf "$R"
