"""flexgen marks functions for torch.compile without importing torch._dynamo (flexgen/dynamo_marks.py),
and an eager call never imports it."""
import subprocess
import sys
from pathlib import Path

import torch

from flexgen import dynamo_marks

ROOT = Path(__file__).resolve().parents[1]


def test_mark_is_dynamos_own():
    from torch._dynamo import assume_constant_result

    def ours():
        return 1

    def theirs():
        return 1

    dynamo_marks.assume_constant_result(ours)
    assume_constant_result(theirs)
    marks = lambda f: {k: v for k, v in vars(f).items()}  # noqa: E731
    assert marks(ours) == marks(theirs) == {"_dynamo_marked_constant": True}


def test_importing_the_runtime_does_not_import_dynamo():
    code = ("import sys, torch, flexgen\n"
            "import flexgen.attention, flexgen.ops, flexgen.variant\n"
            "flexgen.mask_mod(lambda b, h, q, kv: q >= kv)\n"
            "flexgen.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 256, 256, device='cpu')\n"
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_the_eager_fallback_exists_once_dynamo_has_traced_a_call():
    """Under torch.compile, a mod that dynamo cannot hand over runs through torch.compiler.disable'd
    flex_attention, made when the first trace reaches flex_attention's option check."""
    import flexgen.attention as attention

    torch._dynamo.reset()
    attention._checked_options(None)  # what a trace runs for real before it can reach the fallback
    assert attention._flex_attention_eager is not None
    assert attention._flex_attention_eager.__wrapped__ is attention.flex_attention


def test_the_buffer_path_search_is_kept_out_of_traces_once_dynamo_has_traced_a_call():
    """Eager code after a graph break has each function it calls compiled as a frame; the search must not be one."""
    import flexgen.attention as attention
    import flexgen.captures as captures

    torch._dynamo.reset()
    attention._checked_options(None)
    assert captures._untraced_buffer_paths is not captures.buffer_paths
    assert captures._untraced_buffer_paths.__wrapped__ is captures.buffer_paths
    table = torch.randn(4)
    assert captures._untraced_buffer_paths(lambda s, b, h, q, kv: s + table[q], (table,)) == ((("closure", 0),),)
