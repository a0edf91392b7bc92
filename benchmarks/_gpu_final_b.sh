#!/usr/bin/env bash
# Session 3, final GPU call b: sources and nanoTabPFN benchmarks (results for the repository).
set -u
R=$OUT/r; mkdir -p "$R"
timeout 220 python3 benchmarks/bench_sources.py --out "$R" > "$R/bench-sources.log" 2>&1
tail -6 "$R/bench-sources.log"
timeout 330 python3 benchmarks/bench_tabpfn.py --out "$R" > "$R/bench-tabpfn.log" 2>&1
tail -14 "$R/bench-tabpfn.log"
tar -C "$OUT" -cf "$OUT/r.tar" r && rm -rf "$R"
