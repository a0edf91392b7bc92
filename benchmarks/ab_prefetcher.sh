#!/usr/bin/env bash
# A/B of a change on one GPU machine (host figures differ between machines of one kind, so compare only
# within one run): the prefetcher benchmark, gpufeed rows only, alternating a copy of the old package
# and the working tree's, two rounds each.
# Usage there: copy the old src/gpufeed to _ab_old/gpufeed (untracked, so the device tool carries it), then
#   bash benchmarks/ab_prefetcher.sh "$OUT/r"
set -u
R=${1:-/tmp/ab}; mkdir -p "$R"
for round in 1 2; do
  for v in old new; do
    if [ $v = old ]; then P=$PWD/_ab_old; else P=$PWD/src; fi
    PYTHONPATH=/tmp/site:$P timeout 50 python3 benchmarks/bench_prefetcher.py --methods gpufeed \
      --out "$R/$v$round" > "$R/$v$round.log" 2>&1
    echo "== $v $round"; grep "gpufeed \|ceiling:" "$R/$v$round.log" | grep -v "|\|MISS\|met "
  done
done
