#!/usr/bin/env bash
# Second GPU job of a session: the 64k-token single-sequence run, the example's loss curves
# (flexgen / FlexAttention / SDPA), and profiler counters for the main kernels.
#   bash benchmarks/gpu_extras.sh          (writes under $OUT, default benchmarks/results/<UTC time>/, ignored by git)
set -o pipefail
cd "$(dirname "$0")/.." || exit 2
export OUT="${OUT:-$(pwd)/benchmarks/results/$(date -u +%Y%m%d-%H%M%S)}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site; fi
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
STEPS=${STEPS:-300}
echo "== long"
timeout 130 python3 benchmarks/bench_attention.py --long --skip-sweep --out "$OUT/long" 2>&1 | tail -25
for impl in flexgen flex sdpa; do
  echo "== train_lm $impl"
  timeout 110 python3 examples/train_lm.py --impl "$impl" --steps "$STEPS" --log "$OUT/train_$impl.json" 2>&1 | tail -4
done
{
  for kern in flexgen_fwd flexgen_bwd; do
    echo "== ncu $kern (causal, N=4096, D=128)"
    timeout 90 ncu --kernel-name "regex:^${kern}" --launch-skip 1 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
      python3 benchmarks/profile_one.py --variant causal --seqlen 4096 2>&1 | grep -v "^==PROF==" | tail -120
  done
} > "$OUT/ncu.txt" 2>&1
