#!/usr/bin/env bash
# Session 3, GPU call f: the reliability report with the final code.
set -u
R=$OUT/r; mkdir -p "$R"
timeout 200 python3 tests/reliability/report.py --runs 1 > "$R/report.log" 2>&1; tail -2 "$R/report.log"
cp docs/reliability.md tests/reliability/last_run_0.* "$R/"
tar -C "$OUT" -cf "$OUT/r.tar" r && rm -rf "$R"
