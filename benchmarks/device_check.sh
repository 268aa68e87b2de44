#!/usr/bin/env bash
# One device call that checks a tree before it lands, inside one call's time limit: the GPU test suite, the small
# ragged cases against float64 with compute-sanitizer's memcheck and synccheck on grids cut to two CTAs, a kernel-time
# A/B against a base tree (kernel_ab.py), attention-gym's tests, and (optionally) the first half of FA4's wheels
# staged for a later call. Everything it writes under $OUT is packed into $OUT/check.tgz and the rest removed: the
# device hands back a limited number of files.
#
#   bash benchmarks/device_check.sh
#
# Knobs (environment; unset: the step is skipped, but the suite and the small cases):
#   AB_BASE=DIR AB_KIND=fwd|bwd|bwd_all AB_CASES=128:full,96:causal   the A/B (base tree from ab_bench.sh prepare)
#   SMALL_CASES=128:causal,...        small_cases_check.py's cases (default: a D = 128 / 96 / 64 mix)
#   SANITIZE_CASES=128:causal,...     the cases run under memcheck (default: the first two small cases); synccheck
#                                     takes the first
#   GYM=DIR                           an attention-gym checkout (benchmarks/gym_tests.sh), run if time is left
#   FA4_PART=DIR                      fa4_setup.sh stage DIR, in the background
#   BUDGET=seconds (default 540)      no new step starts past it; SUITE_TIMEOUT (default 260)
set -u
T0=$(date +%s)
OUT=${OUT:?set OUT (the device sets it)}
cd "$(dirname "$0")/.." || exit 2
BUDGET=${BUDGET:-540}
SMALL_CASES=${SMALL_CASES:-128:full,128:causal,128:sliding1024,96:full,96:causal,64:causal}
SANITIZE_CASES=${SANITIZE_CASES:-$(echo "$SMALL_CASES" | cut -d, -f1,2)}
elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(elapsed) )); }
note() { echo "== $* (at $(elapsed) s)"; }

[ -n "${FA4_PART:-}" ] && { bash benchmarks/fa4_setup.sh stage "$FA4_PART" > "$OUT/fa4_stage.log" 2>&1 & }
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi -L

note "GPU suite"
timeout "${SUITE_TIMEOUT:-260}" python3 -m pytest -q -rfE -m gpu -n 15 -p no:cacheprovider tests > "$OUT/suite.log" 2>&1
tail -3 "$OUT/suite.log" | cut -c1-300
sleep 2; pkill -f pytest || true  # (workers left by a timeout would share the GPU with the timings)

note "small cases"
timeout 120 python3 benchmarks/small_cases_check.py --ctas 2 --seqlen 1500 --cases "$SMALL_CASES" > "$OUT/small.log" 2>&1
grep -E "^ok|^FAIL|failed$" "$OUT/small.log"
timeout 150 compute-sanitizer --tool memcheck python3 benchmarks/small_cases_check.py --ctas 2 --seqlen 1500 \
    --cases "$SANITIZE_CASES" > "$OUT/memcheck.log" 2>&1
echo "memcheck: $(grep 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)"
timeout 120 compute-sanitizer --tool synccheck python3 benchmarks/small_cases_check.py --ctas 2 --seqlen 1500 \
    --cases "${SANITIZE_CASES%%,*}" > "$OUT/synccheck.log" 2>&1
echo "synccheck: $(grep 'ERROR SUMMARY' "$OUT/synccheck.log" | tail -1)"

if [ -n "${AB_BASE:-}" ] && [ "$(left)" -gt 60 ]; then
    note "kernel A/B (${AB_KIND:-fwd}: ${AB_CASES:-every case})"
    timeout "$(left)" python3 benchmarks/kernel_ab.py run --kind "${AB_KIND:-fwd}" --tree base="$AB_BASE" --tree new=. \
        --rounds 2 ${AB_CASES:+--only "$AB_CASES"} --out "$OUT/ab" > "$OUT/ab.log" 2>&1
    python3 benchmarks/kernel_ab.py report "$OUT/ab" | tee "$OUT/ab_table.md"
fi

if [ -n "${GYM:-}" ] && [ "$(left)" -gt 70 ]; then
    note "attention-gym"
    timeout "$(left)" bash benchmarks/gym_tests.sh "$GYM" "$OUT/gym" -n 14 > "$OUT/gym.log" 2>&1
    head -3 "$OUT/gym/summary.txt" 2>/dev/null
fi

wait
note "packing $OUT"
(cd "$OUT" && tar czf check.tgz --exclude=check.tgz . && find . -mindepth 1 ! -name check.tgz -delete)
