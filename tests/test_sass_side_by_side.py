"""benchmarks/sass_side_by_side.py splits nvdisasm's output into basic blocks of bare opcodes."""
from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "sass_side_by_side.py"

SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/               @P0 BRA `(.L_x_1) ;
.L_x_1:
        /*0020*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT ;
        /*0030*/               @!P1 MUFU.EX2 R2, R3 ;
        /*0040*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
.L_x_2:
        /*0050*/                   EXIT ;
"""


def _module():
    spec = importlib.util.spec_from_file_location("sass_side_by_side", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_blocks_hold_bare_opcodes_in_order_without_predicates():
    blocks = _module().basic_blocks(SASS)
    assert blocks == [("entry", ["LDC", "BRA"]), (".L_x_1", ["HGMMA", "MUFU", "WARPGROUP"]), (".L_x_2", ["EXIT"])]


def test_report_lists_only_blocks_of_the_minimum_size(capsys):
    _module().report("k", SASS, min_block=3)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "== k: 6 instructions in 3 blocks"
    assert len(out) == 2 and out[1].split()[:2] == [".L_x_1", "3"] and "HGMMA=1" in out[1]


def test_mufu_spacing_counts_gaps_of_at_most_two_instructions():
    ops = ["MUFU", "FFMA", "MUFU", "MUFU", "FADD", "FADD", "FADD", "MUFU", "HGMMA"]
    assert _module().mufu_spacing(ops) == (3, 2)
    assert _module().mufu_spacing(["MUFU", "FFMA"]) == (0, 0)


def test_report_shows_mufu_spacing_only_for_blocks_with_two_mufus(capsys):
    sass = SASS.replace("WARPGROUP.DEPBAR.LE gsb0, 0x0", "MUFU.EX2 R4, R5")
    _module().report("k", sass, min_block=3)
    line = capsys.readouterr().out.splitlines()[1]
    assert line.endswith("[MUFU gaps <= 2: 1 of 1]")
    _module().report("k", SASS, min_block=3)
    assert "MUFU gaps" not in capsys.readouterr().out
