#!/usr/bin/env bash
# PyTorch's own FlexAttention test file (test/inductor/test_flex_attention.py of a PyTorch checkout), run against
# flexgen: its `from torch.nn.attention.flex_attention import ...` is pointed at flexgen; the references, shapes
# and tolerances stay PyTorch's. The file is not part of this repository; pass its path.
#   bash benchmarks/pytorch_tests.sh PATH/test_flex_attention.py OUTDIR [pytest args...]
# Writes OUTDIR/test_flex_attention_flexgen.py, OUTDIR/junit.xml and OUTDIR/summary.txt (pass / fail / skip counts,
# and the failures grouped by their error's first line).
set -uo pipefail
src=${1:?path of PyTorch test_flex_attention.py}
out=${2:?output directory}
shift 2
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
mkdir -p "$out" && out=$(cd "$out" && pwd)  # (pytest runs from inside it)
# Files from before PyTorch 2.11 hand PagedAttention.assign 1-D positions, which the installed torch's takes as
# (B, S): those are broadcast over the batch (what the older assign did), so that the paged tests reach flexgen.
sed -e 's/^from torch\.nn\.attention\.flex_attention import /from flexgen import /' \
    -e 's/\.assign(batch_idx, input_pos, /.assign(batch_idx, input_pos if input_pos.dim() == 2 else input_pos.expand(batch_idx.shape[0], -1), /' \
    "$src" > "$out/test_flex_attention_flexgen.py"
grep -q '^from flexgen import' "$out/test_flex_attention_flexgen.py" || { echo "pytorch_tests: no flex_attention import to redirect in $src" >&2; exit 2; }
cd "$out" && PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest -p no:cacheprovider \
    --junitxml="$out/junit.xml" "$@" test_flex_attention_flexgen.py > "$out/pytest.log" 2>&1
rc=$?
"$PY" "$ROOT/benchmarks/junit_summary.py" "$out/junit.xml" > "$out/summary.txt"
tail -3 "$out/pytest.log"
head -60 "$out/summary.txt"
exit $rc
