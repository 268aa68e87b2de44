#!/usr/bin/env bash
# attention-gym's own masks, score_mods and their tests, run against flexgen: in a copy of its `attn_gym/masks`,
# `attn_gym/mods`, `attn_gym/utils.py` and the tests that use them, every
# `from torch.nn.attention.flex_attention import ...` is pointed at flexgen; the references, shapes and tolerances stay
# attention-gym's. The checkout is not part of this repository; pass its path (github.com/meta-pytorch/attention-gym).
#   bash benchmarks/gym_tests.sh PATH/attention-gym OUTDIR [pytest args...]
# Writes OUTDIR/junit.xml and OUTDIR/summary.txt (pass / fail / skip counts, failures grouped by their error's first
# line). Tests of attention-gym's own kernels (linear attention, selected attention, CuTe caches) are left out:
# they do not call flex_attention.
set -uo pipefail
src=${1:?path of an attention-gym checkout}
out=${2:?output directory}
shift 2
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
TESTS="block_diffusion causal_block_mask document_mask global_sliding_window graphormer jetspec merge_attention mods
natten sandwich shared_prefix shared_prefix_split_attention vsa"
mkdir -p "$out" && out=$(cd "$out" && pwd)
rm -rf "$out/attn_gym" "$out/test" && mkdir -p "$out/attn_gym" "$out/test"
cp -r "$src/attn_gym/masks" "$src/attn_gym/mods" "$src/attn_gym/utils.py" "$out/attn_gym/"
# (the package's own __init__ imports its linear and sparse kernels, which need Triton and CuTe builds)
echo '"""attention-gym masks, mods and utils only (benchmarks/gym_tests.sh)."""' > "$out/attn_gym/__init__.py"
for t in $TESTS; do
    [ -f "$src/test/test_$t.py" ] && cp "$src/test/test_$t.py" "$out/test/"
done
find "$out/attn_gym" "$out/test" -name '*.py' -exec sed -i \
    -e 's/^\(\s*\)from torch\.nn\.attention\.flex_attention import /\1from flexgen import /' {} +
n=$(grep -rl '^\s*from flexgen import' "$out/attn_gym" "$out/test" | wc -l)
[ "$n" -gt 0 ] || { echo "gym_tests: no flex_attention import to redirect under $src" >&2; exit 2; }
cd "$out" && PYTHONPATH="$out:$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest -p no:cacheprovider \
    --rootdir="$out" --junitxml="$out/junit.xml" "$@" test > "$out/pytest.log" 2>&1
rc=$?
"$PY" "$ROOT/benchmarks/junit_summary.py" "$out/junit.xml" > "$out/summary.txt"
tail -3 "$out/pytest.log"
head -60 "$out/summary.txt"
exit $rc
