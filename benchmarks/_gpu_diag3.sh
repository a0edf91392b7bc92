#!/usr/bin/env bash
# Session 3, GPU call 3: the consumer's touch beside background readers and copies; small-read sizes.
set -u
R=$OUT/r; mkdir -p "$R"
timeout 150 python3 benchmarks/_diag_touch.py 2>&1 | tee "$R/touch.log"
timeout 150 python3 benchmarks/_diag_small.py --out "$R/small" > "$R/small.log" 2>&1; cat "$R/small.log"
tar -C "$OUT" -cf "$OUT/r.tar" r && rm -rf "$R"
