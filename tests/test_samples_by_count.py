"""benchmarks/samples_by_count.py groups ncu's per-instruction stall samples by executed count."""
from __future__ import annotations

import importlib
import io
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "samples_by_count.py"

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
          '"Instructions Executed","stall_barrier","stall_long_sb","stall_wait","stall_barrier (Not Issued)"')


def _csv(rows):
    lines = ['"Kernel Name","flexgen_fwd",', HEADER]
    for addr, src, samples, executed, barrier, long_sb, wait in rows:
        lines.append(f'"{addr:#x}","{src}","{samples}","0","{executed}","{barrier}","{long_sb}","{wait}","99"')
    return "\n".join(lines) + "\n"


@pytest.fixture
def script(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    return importlib.import_module("samples_by_count")


ROWS = [  # a loop run 6400 times, a tile's code 100 times, an unexecuted retry block
    (0x7F00, "LDC R1, c[0x0][0x28]", 1, 100, 0, 0, 1),
    (0x7F10, "WARPGROUP.DEPBAR.LE gsb0, 0x0", 40, 100, 40, 0, 0),
    (0x7F20, "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24", 300, 6400, 10, 0, 290),
    (0x7F30, "@!P0 BRA 0x7f80", 60, 6400, 0, 60, 0),
    (0x7F40, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2", 0, 0, 0, 0, 0),
]


def test_groups_by_executed_count_with_offsets_and_stall_reasons(script):
    ins = script.read_instructions(_csv(ROWS))
    assert [i.offset for i in ins] == [0, 0x10, 0x20, 0x30, 0x40]
    assert ins[1].stalls == {"stall_barrier": 40, "stall_long_sb": 0, "stall_wait": 0}  # not-issued columns left out
    assert script.by_count(ins) == [(6400, 2, 360), (100, 2, 41), (0, 1, 0)]
    out = io.StringIO()
    script.report(ins, per=[100], top=1, groups=10, out=out)
    text = out.getvalue()
    assert "| 6400 | 2 | 360 | 89.8% |" in text and "| 100 | 2 | 41 | 10.2% |" in text
    assert "executed 100: 2 instructions, 10.2% of the samples" in text
    assert "+0x00010     40 (10.0%)  barrier 40" in text and "LDC" not in text.split("most sampled:")[1]


def test_opcodes_of_one_path_without_predicates(script):
    rows = ROWS + [(0x7F50, "@P1 HGMMA.64x128x16.F32.BF16 R24, gdesc[UR9], R24", 7, 6400, 0, 0, 7)]
    ins = script.read_instructions(_csv(rows))
    assert script.opcode("@!P0 BRA 0x7f80") == "BRA" and script.opcode("NOP") == "NOP"
    ops = script.opcodes(ins, {6400})
    assert ops == {"HGMMA.64x128x16.F32.BF16": (2, 307), "BRA": (1, 60)}
    assert list(ops) == ["HGMMA.64x128x16.F32.BF16", "BRA"]  # most instructions first
    assert script.opcodes(ins, {100, 0}) == {"LDC": (1, 1), "SYNCS.PHASECHK.TRANS64.TRYWAIT": (1, 0),
                                             "WARPGROUP.DEPBAR.LE": (1, 40)}
    out = io.StringIO()
    script.report(ins, per=[6400], top=1, groups=10, out=out, with_opcodes=True)
    assert "opcodes (instructions (samples)): HGMMA.64x128x16.F32.BF16 2 (307), BRA 1 (60)" in out.getvalue()


def test_refuses_a_file_without_instruction_rows(script, tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text('"Kernel Name","x",\n' + HEADER + "\n")
    with pytest.raises(SystemExit, match="no instruction rows"):
        script.main([str(path)])


def test_a_kernel_picked_by_name_from_a_csv_of_several(script):
    pre = _csv([(0x100, "LDG.E R2, desc[UR4][R2.64]", 5, 64, 0, 5, 0)]).replace("flexgen_fwd", "bwd_preprocess")
    text = pre + _csv(ROWS).replace("flexgen_fwd", "FlashAttentionBackwardSm90")
    names = [name for name, _ in script.kernel_sections(text)]
    assert names == ["bwd_preprocess", "FlashAttentionBackwardSm90"]
    name, part = script.pick_kernel(text, "BackwardSm90")
    assert name == "FlashAttentionBackwardSm90" and len(script.read_instructions(part)) == len(ROWS)
    assert script.pick_kernel(text, None)[0] == "bwd_preprocess"  # the first, as before
    with pytest.raises(SystemExit, match="no kernel matches 'postprocess'; the CSV has: bwd_preprocess, Flash"):
        script.pick_kernel(text, "postprocess")


def test_the_summary_gives_stall_shares_and_the_executed_mix(script):
    ins = script.read_instructions(_csv(ROWS))
    shares = script.stall_shares(ins)  # largest first
    assert [name for name, _ in shares] == ["wait", "long_sb", "barrier"]
    assert [share for _, share in shares] == pytest.approx([100 * 291 / 401, 100 * 60 / 401, 100 * 50 / 401])
    assert script.executed_by_opcode(ins) == [("HGMMA", 6400), ("BRA", 6400), ("LDC", 100), ("WARPGROUP", 100),
                                              ("SYNCS", 0)]
    out = io.StringIO()
    script.report(ins, per=[], top=1, groups=10, out=out)
    lines = out.getvalue().splitlines()
    assert lines[0] == "5 instructions, 401 samples, 0.0 M warp instructions executed"
    assert lines[1] == "stalls: wait 72.6%, long_sb 15.0%, barrier 12.5%"
