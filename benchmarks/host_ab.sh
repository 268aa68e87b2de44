#!/usr/bin/env bash
# The host path's A/B: host_path.py on two flexgen trees, alternated in fresh processes pinned to one core, in one
# device call. A host runs everything up to a third faster or slower from one process to the next, so a tree's
# figures mean something only beside the other tree's from the neighbouring processes (and SDPA's from its own).
#
#   bash benchmarks/host_ab.sh BASE_DIR [ROUNDS] [CORE]   BASE_DIR: a tree holding flexgen/ (`ab_bench.sh prepare
#                                                          REV` makes one); ROUNDS alternations (default 3) of
#                                                          BASE_DIR's flexgen ("base") and this checkout's ("this"),
#                                                          on CPU core CORE (default the last;
#                                                          unpinned without taskset)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
base=${1:?usage: bash benchmarks/host_ab.sh BASE_DIR [ROUNDS] [CORE]}
rounds=${2:-3}
core=${3:-$(( $(nproc) - 1 ))}
[ -f "$base/flexgen/__init__.py" ] || { echo "host_ab: $base holds no flexgen package" >&2; exit 2; }
pin=()
command -v taskset > /dev/null && pin=(taskset -c "$core")
for round in $(seq "$rounds"); do
    for label in base this; do
        tree=$ROOT
        [ "$label" = base ] && tree=$base
        echo "== $label, round $round"
        FLEXGEN_TREE=$tree "${pin[@]}" "$PY" "$ROOT/benchmarks/host_path.py" --impls flexgen,sdpa --calls 2000 \
            | grep -E '^  (flexgen|sdpa) '
    done
done
