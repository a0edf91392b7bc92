#!/usr/bin/env bash
# A/B/C... of changes on one GPU machine: the prefetcher benchmark, gpufeed rows only, each variant in
# turn, ROUNDS rounds (host figures differ between machines of one kind: compare only within one run).
# A variant is NAME:ROOT[:ENV...]: the gpufeed package under ROOT (src, or an untracked copy such as
# _ab_old made with `git archive`), and environment assignments separated by commas.
# GPUFEED_DIAG_SWITCH=<seconds> sets sys.setswitchinterval for that variant (a diagnostic only).
# Usage there: bash benchmarks/ab_variants.sh "$OUT/r" 2 old:_ab_old new:src new14:src:GPUFEED_COPY_THREADS=14
set -u
R=$1; rounds=$2; shift 2; mkdir -p "$R"
for round in $(seq "$rounds"); do
  for spec in "$@"; do
    IFS=: read -r name root envs <<< "$spec"
    log="$R/$name$round.log"
    env ${envs//,/ } PYTHONPATH="/tmp/site:$PWD/$root" timeout 60 python3 -c '
import os, runpy, sys
if os.environ.get("GPUFEED_DIAG_SWITCH"):
    sys.setswitchinterval(float(os.environ["GPUFEED_DIAG_SWITCH"]))
sys.argv = ["bench_prefetcher.py", *sys.argv[1:]]
runpy.run_path("benchmarks/bench_prefetcher.py", run_name="__main__")
' --methods gpufeed --out "$R/$name$round" > "$log" 2>&1
    echo "== $name $round"; grep "gpufeed \|ceiling:" "$log" | grep -v "|\|MISS\|met "
  done
done
