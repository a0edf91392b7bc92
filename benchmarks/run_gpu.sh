#!/usr/bin/env bash
# Everything that needs the GPU machine: the cuda-marked tests, then every benchmark.
# Usage there (after the .devwhl prepare line):  bash benchmarks/run_gpu.sh "$OUT/r" --pack [part]
# part: "a" (the CUDA tests, the grid), "c" (the prefetcher benchmark, gpufeed bench), "b" (sources, tabpfn,
# resnet), "l" (the training loops' small steps, mlp and token), "m" and "n" (the loops' cnn step, its resnet
# step), "v" (the verdict's cases), "t" (the trainers: bench_trainers.py, and on 2 GPUs where there are 2,
# examples/accelerate_launch.py --check and bench_trainers.py's accelerate rows per process; needs
# pip install -e '.[integrations]' lightning), "u" (the loops benchmark's steps in those trainers) or "r" (the
# reliability report, whose page docs/reliability.md is copied into the folder); "ab" when left out. Parts
# "a", "c", "l", "m", "n" and "v" each fit one call of 600 s on an H200; run the steps of the others in calls of
# their own. bench_loops saves its results after each feed: a step cut short by its time limit keeps what it ran.
set -u
out=${1:-benchmarks/results}
part=${3:-ab}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
if [[ $part == *a* ]]; then  # (the CUDA tests about 130 s, the grid about 275 s on an H200)
  timeout 240 python3 -m pytest -m cuda tests -q -p no:cacheprovider -rs 2>&1 | tee "$out/cuda-tests.log" | tail -4
  timeout 340 python3 benchmarks/bench_grid.py --out "$out" > "$out/bench-grid.log" 2>&1
  tail -6 "$out/bench-grid.log"
fi
if [[ $part == *c* ]]; then
  timeout 240 python3 benchmarks/bench_prefetcher.py --out "$out" > "$out/bench-prefetcher.log" 2>&1
  tail -12 "$out/bench-prefetcher.log"
  (cd /tmp && timeout 120 python3 -m gpufeed.cli bench --trace --out "$out/cli-bench" > "$out/cli-bench.log" 2>&1)
  tail -9 "$out/cli-bench.log"
fi
if [[ $part == *b* ]]; then
  timeout 200 python3 benchmarks/bench_sources.py --out "$out" > "$out/bench-sources.log" 2>&1
  tail -6 "$out/bench-sources.log"
  timeout 300 python3 benchmarks/bench_tabpfn.py --out "$out" > "$out/bench-tabpfn.log" 2>&1
  tail -14 "$out/bench-tabpfn.log"
  timeout 200 python3 benchmarks/bench_resnet.py --out "$out" > "$out/bench-resnet.log" 2>&1
  tail -16 "$out/bench-resnet.log"
fi
if [[ $part == *t* ]]; then
  timeout 500 python3 benchmarks/bench_trainers.py --out "$out" > "$out/bench-trainers.log" 2>&1
  tail -16 "$out/bench-trainers.log"
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    timeout 200 accelerate launch --num_processes 2 examples/accelerate_launch.py --check \
      > "$out/accelerate-launch.log" 2>&1
    tail -4 "$out/accelerate-launch.log"
    timeout 200 accelerate launch --num_processes 2 benchmarks/bench_trainers.py --trainers accelerate \
      --out "$out" > "$out/bench-trainers-launch.log" 2>&1
    tail -8 "$out/bench-trainers-launch.log"
  fi
fi
if [[ $part == *u* ]]; then  # (the loops benchmark's steps in accelerate, Lightning and HF Trainer: minutes)
  timeout 560 python3 benchmarks/bench_trainers.py --loops mlp,token,cnn,resnet --out "$out" \
    > "$out/bench-trainers-loops.log" 2>&1
  tail -30 "$out/bench-trainers-loops.log"
fi
if [[ $part == *l* ]]; then  # (mlp about 290 s, token about 200 s on an H200; each step in a folder of its own)
  for step in mlp token; do
    timeout 300 python3 benchmarks/bench_loops.py --steps $step --out "$out/loops-$step" \
      > "$out/bench-loops-$step.log" 2>&1
    grep -A3 '^| target' "$out/loops-$step"/loops-*.md
  done
fi
if [[ $part == *m* ]]; then  # (cnn about 290 s, resnet about 330 s: one call each, "m" and "n")
  timeout 560 python3 benchmarks/bench_loops.py --steps cnn --out "$out/loops-cnn" \
    > "$out/bench-loops-cnn.log" 2>&1
  grep -A3 '^| target' "$out/loops-cnn"/loops-*.md
fi
if [[ $part == *n* ]]; then
  timeout 560 python3 benchmarks/bench_loops.py --steps resnet --out "$out/loops-resnet" \
    > "$out/bench-loops-resnet.log" 2>&1
  grep -A4 '^| target' "$out/loops-resnet"/loops-*.md
fi
if [[ $part == *v* ]]; then
  timeout 200 python3 benchmarks/bench_verdict.py --out "$out" > "$out/bench-verdict.log" 2>&1
  tail -8 "$out/bench-verdict.log"
fi
if [[ $part == *r* ]]; then
  timeout 200 python3 tests/reliability/report.py --runs 1 > "$out/reliability-report.log" 2>&1
  tail -2 "$out/reliability-report.log"
  cp docs/reliability.md "$out/"
fi
# The device tool returns at most 8 files: pack everything into one archive beside the folder.
if [ "${2:-}" = "--pack" ]; then
  tar -C "$(dirname "$out")" -cf "$out.tar" "$(basename "$out")" && rm -rf "$out"
fi
