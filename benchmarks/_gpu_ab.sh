#!/usr/bin/env bash
# A/B on one machine: the prefetcher benchmark (gpufeed only) with _ab_old/gpufeed and with src/gpufeed.
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
tar -C "$OUT" -cf "$OUT/r.tar" r && rm -rf "$R"
