"""benchmarks/static_ab.py finds a kernel's step loop in nvdisasm's output."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "static_ab.py"


@pytest.fixture
def script(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    return importlib.import_module("static_ab")


def _sass(blocks):
    """nvdisasm -c style text: (label or None, [instructions]) per block, addresses counting up by 16."""
    lines, address = [], 0
    for label, instructions in blocks:
        if label:
            lines.append(f"{label}:")
        for ins in instructions:
            lines.append(f"        /*{address:04x}*/                   {ins} ;")
            address += 16
    return "\n".join(lines) + "\n"


PRODUCTS = ["HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24"] * 8
EXPONENTIALS = ["MUFU.EX2 R3, R4"] * 32


def test_the_step_loop_is_the_innermost_loop_with_products_and_exponentials(script):
    sass = _sass([
        (".L_x_1", ["IMAD R1, R2, R3, RZ"]),  # the work-tile loop starts
        (".L_x_2", PRODUCTS + EXPONENTIALS + ["FADD R5, R5, R6", "@P0 BRA `(.L_x_2)"]),  # the step loop
        (None, PRODUCTS + ["MUFU.RCP R7, R8", "@!P1 BRA `(.L_x_1)"]),  # the tile's last product and epilogue
        (".L_x_3", ["NOP", "BRA `(.L_x_3)"]),  # the end's spin: no products
    ])
    loop = script.step_loop(sass)
    assert loop["HGMMA"] == 8 and loop["MUFU"] == 32 and loop["FADD"] == 1 and loop["BRA"] == 1
    assert sum(loop.values()) == 8 + 32 + 2


def test_a_loop_without_enough_exponentials_is_not_a_step(script):
    sass = _sass([(".L_x_1", PRODUCTS + ["MUFU.EX2 R3, R4"] * 31 + ["@P0 BRA `(.L_x_1)"])])
    assert script.step_loop(sass) is None


def test_forward_branches_and_predicates_are_not_loops(script):
    sass = _sass([(None, ["@P0 BRA `(.L_x_9)"] + PRODUCTS + EXPONENTIALS), (".L_x_9", ["EXIT"])])
    assert script.step_loop(sass) is None
    assert script.bare_opcode("@!P2 SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR38+0x40], RZ") == "SYNCS"
