#!/usr/bin/env bash
# Session 3, GPU call e: inline threshold 4 MiB (_ab_old) against 1 MiB (src) on one machine; the prefetcher
# benchmark with the final code; cuda tests; nanoTabPFN.
set -u
R=$OUT/r; mkdir -p "$R"
for round in 1 2; do
  for v in old new; do
    if [ $v = old ]; then P=$PWD/_ab_old; else P=$PWD/src; fi
    PYTHONPATH=/tmp/site:$P timeout 50 python3 benchmarks/bench_prefetcher.py --methods gpufeed \
      --out "$R/$v$round" > "$R/$v$round.log" 2>&1
    echo "== $v $round"; grep "gpufeed \|ceiling:" "$R/$v$round.log" | grep -v "|\|MISS\|met "
  done
done
timeout 120 python3 benchmarks/bench_prefetcher.py --out "$R/final" > "$R/bench-prefetcher.log" 2>&1
grep "gpufeed\|pin_non\|ceiling:" "$R/bench-prefetcher.log" | grep -v "|" | head -8
timeout 200 python3 -m pytest -m cuda tests -q -p no:cacheprovider -rs > "$R/cuda-tests.log" 2>&1
tail -1 "$R/cuda-tests.log"
timeout 230 python3 benchmarks/bench_tabpfn.py --out "$R" > "$R/bench-tabpfn.log" 2>&1
grep "^| \(ideal\|orig\|gpufeed\)" "$R"/tabpfn-*.md | cut -c1-120
tar -C "$OUT" -cf "$OUT/r.tar" r && rm -rf "$R"
