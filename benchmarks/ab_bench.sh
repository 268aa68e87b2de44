#!/usr/bin/env bash
# A/B: the same bench_attention.py command on two flexgen trees, alternated, each with its own kernel cache, in
# one device call (same machine, same clocks: machines differ by 5-10%, so only an A/B within one call says
# whether a change helped).
#
#   bash benchmarks/ab_bench.sh prepare REV [DIR]        here: REV's tracked files into DIR (default .gpu/ab_base,
#                                                         which must be git-ignored; carry it in the call)
#   bash benchmarks/ab_bench.sh run [DIR] [ROUNDS] -- ARGS   on the GPU machine: ROUNDS (default 2) alternations of
#                                                         DIR's tree ("base") and this tree ("this"), each running
#                                                         bench_attention.py ARGS; prints the table rows, labelled
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}

usage() {
    sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
}

prepare() {
    local rev=$1 dir=${2:-.gpu/ab_base}
    cd "$ROOT"
    git check-ignore -q "$dir" || { echo "ab_bench: $dir is not ignored by git; it would travel twice" >&2; exit 1; }
    rm -rf "$dir" && mkdir -p "$dir"
    git archive "$rev" | tar -x -C "$dir"
    echo "ab_bench: $(git rev-parse --short "$rev") in $dir ($(du -sh "$dir" | cut -f1)); carry it in the device call"
}

run() {
    local dir=.gpu/ab_base rounds=2
    if [ $# -gt 0 ] && [ "$1" != "--" ]; then dir=$1; shift; fi
    if [ $# -gt 0 ] && [ "$1" != "--" ]; then rounds=$1; shift; fi
    [ "${1:-}" = "--" ] && shift
    [ -d "$ROOT/$dir/flexgen" ] || { echo "ab_bench: no flexgen tree in $dir (run prepare first)" >&2; exit 1; }
    local i label tree
    for ((i = 1; i <= rounds; i++)); do
        for label in base this; do
            if [ "$label" = base ]; then tree=$ROOT/$dir; else tree=$ROOT; fi
            (cd "$tree" && PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" FLEXGEN_CACHE_DIR=/tmp/ab_cache_$label \
                $PY benchmarks/bench_attention.py --impls flexgen --out "/tmp/ab_out_$label" "$@" 2>&1 \
                | grep '^| [0-9]' | sed "s/^/$label $i: /") || echo "$label $i: bench_attention.py failed"
        done
    done
}

[ $# -ge 1 ] || usage
cmd=$1
shift
case "$cmd" in
    prepare) [ $# -ge 1 ] || usage; prepare "$@" ;;
    run) run "$@" ;;
    *) usage ;;
esac
