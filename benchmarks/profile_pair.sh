#!/usr/bin/env bash
# ncu profiles (`--set full`, locked base clocks) of flexgen's main kernel and FlashAttention-4's for the same cases,
# exported as CSV for reading without a GPU, in one device call:
#
#   CASES="128:sliding1024 96:full" KIND=bwd bash benchmarks/profile_pair.sh [both|flexgen|fa4]
#
# Per case and implementation: NAME_details.csv (`ncu --page details`: duration, clock, issue slots, occupancy,
# memory) and NAME_sass.csv (`--page source --print-source sass`: stall samples and executed counts per instruction;
# benchmarks/samples_by_count.py reads it, `--kernel bwd_sm90` for FA4's main kernel among its three). NAME is
# fg_ or fa4_, then KIND, D and the variant. The reports themselves are not kept, and everything under $OUT is packed
# into $OUT/profiles.tgz (the device hands back a limited number of files).
# FA4 must be installed (fa4_setup.sh; its env.sh is sourced when present); its variants are profile_one.py's (full,
# causal, sliding<W>). flexgen's kernel is the second call's; FA4's the second of its forward, or of its backward's
# three kernels (preprocess, main kernel, postprocess).
set -u
OUT=${OUT:?set OUT (the device sets it)}
cd "$(dirname "$0")/.." || exit 2
WHICH=${1:-both}
KIND=${KIND:-bwd}
CASES=${CASES:-128:causal}
[ -f /tmp/fa4/env.sh ] && . /tmp/fa4/env.sh
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
T0=$(date +%s)
FWD_ONLY=""
[ "$KIND" = fwd ] && FWD_ONLY=--fwd-only

profile() {  # name impl d variant kernel-regex skip count
    local name=$1 impl=$2 d=$3 variant=$4 regex=$5 skip=$6 count=$7
    timeout 240 ncu --set full --import-source no --clock-control base -k "regex:$regex" --launch-skip "$skip" \
        --launch-count "$count" -o "$OUT/$name" -f python3 benchmarks/profile_one.py --impl "$impl" \
        --variant "$variant" --seqlen 8192 --head-dim "$d" $FWD_ONLY > "$OUT/$name.log" 2>&1
    ncu -i "$OUT/$name.ncu-rep" --page details --csv > "$OUT/${name}_details.csv" 2>> "$OUT/$name.log"
    ncu -i "$OUT/$name.ncu-rep" --page source --csv --print-source sass > "$OUT/${name}_sass.csv" 2>> "$OUT/$name.log"
    rm -f "$OUT/$name.ncu-rep"
    echo "$name: $(grep -c . "$OUT/${name}_details.csv") detail rows (at $(( $(date +%s) - T0 )) s)"
}

for case in $CASES; do
    d=${case%%:*}; variant=${case#*:}
    if [ "$WHICH" != fa4 ]; then
        profile "fg_${KIND}_d${d}_${variant}" flexgen "$d" "$variant" "^flexgen_${KIND}$" 1 1
    fi
    if [ "$WHICH" != flexgen ]; then
        if [ "$KIND" = fwd ]; then
            profile "fa4_${KIND}_d${d}_${variant}" fa4 "$d" "$variant" "(?i)forward" 1 1
        else
            profile "fa4_${KIND}_d${d}_${variant}" fa4 "$d" "$variant" "(?i)(bwd|backward)" 3 3
        fi
    fi
done
(cd "$OUT" && tar czf profiles.tgz --exclude=profiles.tgz . && find . -mindepth 1 ! -name profiles.tgz -delete)
