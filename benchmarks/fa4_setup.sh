#!/usr/bin/env bash
# FlashAttention-4 (flash-attn-4 with nvidia-cutlass-dsl) on the GPU machine, which reaches no
# package index, from wheels carried in two device calls (one call carries at most 64 MiB with the
# tree, and the nvidia-cutlass-dsl-libs-cu13 wheel alone is about 88 MiB).
#
#   bash benchmarks/fa4_setup.sh prepare DIR WHEELS   here: WHEELS (a folder of downloaded wheels)
#                                                     into DIR/part1 and DIR/part2, each under 50 MiB
#   bash benchmarks/fa4_setup.sh stage DIR            call 1, DIR/part1 carried: keep its files in
#                                                     /tmp/fa4parts (a warm machine keeps /tmp)
#   bash benchmarks/fa4_setup.sh install DIR          call 2, DIR/part2 carried: add its files, join the
#                                                     split wheel, check it, install every wheel into
#                                                     /tmp/fa4 with one pip --target, write /tmp/fa4/env.sh
#                                                     and check that FA4 imports
#
# Then `. /tmp/fa4/env.sh` (benchmarks/gpu_session.sh does it when the file exists) puts FA4 on
# PYTHONPATH. All wheels go into one pip call: wheels installed one at a time into one --target
# skip the later ones that share the nvidia_cutlass_dsl folder. pip --target does not run
# nvidia-cutlass-dsl's .pth file, so env.sh adds its dsl_packages folder itself.
# The wheels (python 3.12, manylinux_2_28_x86_64, --no-deps): flash-attn-4, nvidia-cutlass-dsl,
# nvidia-cutlass-dsl-libs-base, -libs-core, -libs-cu13, apache-tvm-ffi, quack-kernels, einops,
# torch-c-dlpack-ext. Knobs: FA4_PARTS (default /tmp/fa4parts), FA4_TARGET (default /tmp/fa4),
# PYTHON (default python3), FA4_PART_LIMIT (bytes a part may hold; default 50 MiB).
set -euo pipefail

PARTS=${FA4_PARTS:-/tmp/fa4parts}
TARGET=${FA4_TARGET:-/tmp/fa4}
PY=${PYTHON:-python3}
LIMIT=${FA4_PART_LIMIT:-52428800}

die() { echo "fa4_setup: $*" >&2; exit 1; }
size_of() { stat -c %s "$1"; }

usage() {
    sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
}

# Split the one wheel over LIMIT in two, so that part1 (its head and every other wheel) and part2
# (its tail) are about the same size; write the whole wheel's sha256 so that install can check the join.
prepare() {
    local dir=$1 src=$2
    [ -d "$src" ] || die "no wheel folder $src"
    local wheels=("$src"/*.whl)
    [ -e "${wheels[0]}" ] || die "no .whl files in $src"
    local big="" small_total=0 w
    for w in "${wheels[@]}"; do
        if [ "$(size_of "$w")" -gt "$LIMIT" ]; then
            [ -z "$big" ] || die "more than one wheel over $LIMIT bytes ($big, $w): split them by hand"
            big=$w
        else
            small_total=$(( small_total + $(size_of "$w") ))
        fi
    done
    rm -rf "$dir/part1" "$dir/part2"
    mkdir -p "$dir/part1" "$dir/part2"
    for w in "${wheels[@]}"; do
        [ "$w" = "$big" ] || cp "$w" "$dir/part1/"
    done
    if [ -n "$big" ]; then
        local name total head
        name=$(basename "$big")
        total=$(size_of "$big")
        head=$(( (total - small_total) / 2 ))
        [ "$head" -gt 0 ] || head=$(( total / 2 ))
        head -c "$head" "$big" >"$dir/part1/$name.part-aa"
        tail -c +"$(( head + 1 ))" "$big" >"$dir/part2/$name.part-ab"
        (cd "$src" && sha256sum "$name") >"$dir/part1/$name.sha256"
    fi
    local part bytes
    for part in part1 part2; do
        bytes=$(du -sb "$dir/$part" | cut -f1)
        echo "$dir/$part: $(( bytes / 1048576 )) MiB: $(ls "$dir/$part" | tr '\n' ' ')"
        [ "$bytes" -le "$LIMIT" ] || echo "!! $dir/$part is over $LIMIT bytes: it may not fit in one call with the tree" >&2
    done
}

# Copy whatever this call carried (wheels, parts, checksums) into PARTS.
stage() {
    local dir=$1 n=0 f
    mkdir -p "$PARTS"
    for f in "$dir"/*.whl "$dir"/*.whl.part-* "$dir"/*.whl.sha256 "$dir"/*/*.whl "$dir"/*/*.whl.part-* "$dir"/*/*.whl.sha256; do
        [ -f "$f" ] || continue
        cp "$f" "$PARTS/"
        n=$(( n + 1 ))
    done
    echo "staged $n files from $dir in $PARTS: $(ls "$PARTS" | tr '\n' ' ')"
}

install() {
    local dir=$1 f name
    if [ -d "$dir" ]; then stage "$dir"; else echo "no $dir in this call: installing from what $PARTS holds"; fi
    [ -d "$PARTS" ] || die "nothing staged in $PARTS: run 'stage' in the call that carries part1 first"
    for f in "$PARTS"/*.whl.part-aa; do
        [ -f "$f" ] || continue
        name=$(basename "${f%.part-aa}")
        [ -f "$PARTS/$name.part-ab" ] || die "$name: part-ab missing from $PARTS; carry part2 in this call"
        cat "$PARTS/$name".part-a? >"$PARTS/$name.joining"
        if [ -f "$PARTS/$name.sha256" ]; then
            [ "$(sha256sum <"$PARTS/$name.joining" | cut -d' ' -f1)" = "$(cut -d' ' -f1 "$PARTS/$name.sha256")" ] \
                || die "$name: the joined parts do not match its sha256 (a part from another split?)"
        fi
        mv "$PARTS/$name.joining" "$PARTS/$name"
        echo "joined $name ($(( $(size_of "$PARTS/$name") / 1048576 )) MiB)"
    done
    local wheels=("$PARTS"/*.whl)
    [ -e "${wheels[0]}" ] || die "no wheels in $PARTS"
    local pyver
    pyver=$($PY -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    [ "$pyver" = 3.12 ] || echo "!! $PY is Python $pyver; these wheels are for 3.12" >&2
    rm -rf "$TARGET"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$TARGET" "${wheels[@]}"
    local dsl="$TARGET/nvidia_cutlass_dsl/dsl_packages"
    [ -d "$dsl" ] || die "no $dsl after the install: was nvidia-cutlass-dsl-libs-base among the wheels?"
    cat >"$TARGET/env.sh" <<EOF
# FlashAttention-4 from benchmarks/fa4_setup.sh: source this file.
export PYTHONPATH="$TARGET:$dsl\${PYTHONPATH:+:\$PYTHONPATH}"
EOF
    echo "installed into $TARGET: $(ls "$TARGET" | grep -c dist-info) distributions; environment: . $TARGET/env.sh"
    cat "$TARGET/env.sh"
    # shellcheck disable=SC1091
    . "$TARGET/env.sh"
    $PY - <<'EOF'
import importlib.metadata as m
import flash_attn.cute.interface  # noqa: F401  (imports cutlass too)
import torch
print("FA4 imports:", ", ".join(f"{d} {m.version(d)}" for d in ("flash-attn-4", "nvidia-cutlass-dsl", "quack-kernels")),
      f"(torch {torch.__version__}, cuda {torch.version.cuda})")
EOF
}

[ $# -ge 1 ] || usage
cmd=$1
shift
case "$cmd" in
    prepare) [ $# -eq 2 ] || usage; prepare "$1" "$2" ;;
    stage) [ $# -eq 1 ] || usage; stage "$1" ;;
    install) [ $# -eq 1 ] || usage; install "$1" ;;
    *) usage ;;
esac
