#!/usr/bin/env bash
# One GPU session in one command: environment report, the GPU test suite, then the benchmark.
#
#   bash benchmarks/gpu_session.sh [benchmark arguments...]
#
# e.g.  bash benchmarks/gpu_session.sh --quick
#       bash benchmarks/gpu_session.sh --dims 128 --variants causal,document-causal --fwd-only
#       SKIP_TESTS=1 bash benchmarks/gpu_session.sh --long
#
# Runs from the repository root (flexgen is imported from there, not installed). Writes
# $OUT/gpu_tests.log, $OUT/bench.log and the benchmark's bench_results.{json,md} and
# bench_plot.png. $OUT defaults to benchmarks/results/<UTC time>/, which git ignores: raw
# logs stay out of the tree (the current figures are copied into benchmarks/results.md).
# Exits nonzero if the tests failed; the benchmark runs either way. The whole command is
# kept inside SESSION_BUDGET seconds (default 560, under the device's 600 s limit): the
# tests get at most TEST_TIMEOUT seconds (default 330: about 390 tests took over 200 s with -n 12, the transformers
# models under inductor last), the benchmark the rest (it stops
# starting new cases in time to print its table).
#
# FlashAttention-4: when benchmarks/fa4_setup.sh has installed it on this machine (its env.sh,
# default /tmp/fa4/env.sh, exists), the session sources that file, so the benchmark finds FA4 and
# adds it to its default implementations (bench_attention.py does so only when FA4 imports).
#
# Environment knobs: SESSION_BUDGET, TEST_TIMEOUT, PER_TEST_TIMEOUT (default 120),
# SKIP_TESTS=1, SKIP_BENCH=1, PYTEST_ARGS (extra pytest arguments), FLEXGEN_CACHE_DIR,
# FA4_ENV (default /tmp/fa4/env.sh).
set -o pipefail
export PYTHONUNBUFFERED=1
START=$(date +%s)
cd "$(dirname "$0")/.." || exit 2
REPO=$(pwd)
export OUT="${OUT:-$REPO/benchmarks/results/$(date -u +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
SESSION_BUDGET=${SESSION_BUDGET:-560}
TEST_TIMEOUT=${TEST_TIMEOUT:-330}
PER_TEST_TIMEOUT=${PER_TEST_TIMEOUT:-120}
PY=${PYTHON:-python3}

# Carried wheels (a .whl folder in the repository root), installed outside the image's site-packages.
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    echo "== installing carried wheels: $(ls .whl/*.whl | xargs -n1 basename | tr '\n' ' ')"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} \
        || echo "!! wheel install failed; going on with the image's packages"
fi
# FlashAttention-4 installed by benchmarks/fa4_setup.sh, if it was.
FA4_ENV=${FA4_ENV:-/tmp/fa4/env.sh}
if [ -f "$FA4_ENV" ]; then
    echo "== FlashAttention-4 environment: $FA4_ENV"
    # shellcheck disable=SC1090
    . "$FA4_ENV"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
# A kernel cache carried with the tree, if there is one.
if [ -z "${FLEXGEN_CACHE_DIR:-}" ] && [ -d "$REPO/.flexgen-cache" ]; then
    export FLEXGEN_CACHE_DIR="$REPO/.flexgen-cache"
fi

echo "== environment"
nvidia-smi -L || echo "!! nvidia-smi failed"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,memory.used --format=csv 2>/dev/null || true
$PY - <<'EOF' || echo "!! environment probe failed"
import sys, torch
print(f"python {sys.version.split()[0]}; torch {torch.__version__}; cuda {torch.version.cuda}; cudnn {torch.backends.cudnn.version()}")
if torch.cuda.is_available():
    print(f"device {torch.cuda.get_device_name()} capability {torch.cuda.get_device_capability()}")
for name in ("triton", "cupy", "matplotlib", "pytest_timeout", "hypothesis"):
    try:
        mod = __import__(name)
        print(f"{name} {getattr(mod, '__version__', '?')}")
    except Exception as e:
        print(f"{name}: not importable ({e})")
try:
    from cupy_backends.cuda.libs import nvrtc
    print("nvrtc", nvrtc.getVersion())
except Exception as e:
    print(f"nvrtc: not available ({e})")
try:  # versions only: the benchmark itself checks that FA4 imports before adding it
    import importlib.metadata as md
    print(f"FA4: flash-attn-4 {md.version('flash-attn-4')}, nvidia-cutlass-dsl {md.version('nvidia-cutlass-dsl')}")
except Exception as e:
    print(f"FA4: not installed ({type(e).__name__}: {e}); the benchmark runs without it")
import flexgen
print(f"flexgen {flexgen.__version__} from {flexgen.__file__}")
EOF

TEST_RC=0
if [ "${SKIP_TESTS:-0}" != "1" ]; then
    echo "== GPU tests (at most ${TEST_TIMEOUT}s)"
    PER_TEST=""
    $PY -c "import pytest_timeout" 2>/dev/null && PER_TEST="--timeout=$PER_TEST_TIMEOUT"
    # shellcheck disable=SC2086
    timeout --signal=INT --kill-after=15 "$TEST_TIMEOUT" \
        $PY -m pytest -q -rfE -m gpu ${TEST_PATHS:-tests} --maxfail=${MAXFAIL:-25} $PER_TEST -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 \
        | tee "$OUT/gpu_tests.log"
    TEST_RC=$?
    [ "$TEST_RC" = 124 ] && echo "!! GPU tests ran past ${TEST_TIMEOUT}s and were stopped"
    echo "== GPU tests exit code: $TEST_RC"
fi

BENCH_RC=0
if [ "${SKIP_BENCH:-0}" != "1" ]; then
    NOW=$(date +%s)
    LEFT=$(( SESSION_BUDGET - (NOW - START) - 45 ))
    [ "$LEFT" -lt 60 ] && LEFT=60
    echo "== benchmark (time budget ${LEFT}s): $*"
    $PY benchmarks/bench_attention.py --out "$OUT" --time-budget "$LEFT" "$@" 2>&1 | tee "$OUT/bench.log"
    BENCH_RC=$?
    echo "== benchmark exit code: $BENCH_RC"
fi

echo "== session: tests rc=$TEST_RC, benchmark rc=$BENCH_RC, $(( $(date +%s) - START ))s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
if [ "$TEST_RC" != 0 ]; then
    exit 1
fi
exit "$BENCH_RC"
