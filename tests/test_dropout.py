"""Attention dropout without a GPU: the torch Philox reference against published known answers,
the kernels' CUDA header (compiled for the host) against the torch reference, the keep mask's
layout and statistics, argument checks, and dropout code only in kernels built with it."""
from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from flexgen.codegen.api import emit
from flexgen.dropout import (DROPOUT_ROUNDS, check_dropout, dropout_keep_mask, dropout_scale, dropout_threshold,
                             philox4x32)

HEADER_DIR = Path(__file__).resolve().parents[1] / "flexgen" / "templates" / "common"

# Random123's kat_vectors for philox4x32_10: counter, key -> output.
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_philox_known_answers(counter, key, expected):
    got = philox4x32(torch.tensor(counter), torch.tensor(key))
    assert tuple(got.tolist()) == expected


def _philox_python(c: list[int], k: list[int], rounds: int) -> list[int]:
    """Philox4x32-R on Python ints (no overflow anywhere): an independent check of the torch one."""
    m = 0xFFFFFFFF
    k0, k1 = k
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & m, (k1 + 0xBB67AE85) & m
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & m, (p0 >> 32) ^ c[3] ^ k1, p0 & m]
    return c


@pytest.mark.parametrize("rounds", [7, 10])
def test_philox_vectorised_matches_python_ints(rounds):
    rng = random.Random(rounds)
    edges = [0, 1, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF]
    counters = [[rng.choice(edges) if rng.random() < 0.3 else rng.getrandbits(32) for _ in range(4)] for _ in range(300)]
    keys = [[rng.getrandbits(32), rng.getrandbits(32)] for _ in range(300)]
    got = philox4x32(torch.tensor(counters), torch.tensor(keys), rounds).tolist()
    assert got == [_philox_python(c, k, rounds) for c, k in zip(counters, keys)]


@pytest.mark.parametrize("p", [0.01, 0.1, 0.5, 0.9])
def test_keep_rates_and_neighbours_are_as_independent_draws(p):
    """The seven-round draw the kernels use: over 2^20 elements each p keeps 1 - threshold / 2^16 of them within five
    standard deviations, and neighbours in a group (the two halves of a word, the rows of a word pair, the words of a
    call) agree as often as independent draws would."""
    seed = random.Random().getrandbits(64)
    m = dropout_keep_mask(seed, 3, 1, 4, 512, 512, p)
    keep = 1 - dropout_threshold(p) / 2**16
    n = m.numel()
    sigma = (keep * (1 - keep) / n) ** 0.5
    assert abs(m.float().mean().item() - keep) < 5 * sigma, seed
    agree = keep**2 + (1 - keep) ** 2  # two independent draws agree this often
    pairs = {"halves of a word": (m[..., 0::2], m[..., 1::2]), "rows q, q + 1": (m[:, :, 0::2], m[:, :, 1::2]),
             "rows q, q + 8": (m[:, :, 0::16], m[:, :, 8::16])}
    for name, (a, b) in pairs.items():
        sigma = (agree * (1 - agree) / a.numel()) ** 0.5
        assert abs((a == b).float().mean().item() - agree) < 5 * sigma, (name, seed)


def test_threshold_and_argument_checks():
    assert dropout_threshold(0.0) == 0 and dropout_scale(0.0) == 1.0
    assert dropout_threshold(0.5) == 2**15 and dropout_scale(0.5) == 2.0
    assert dropout_threshold(0.25) == 2**14
    assert dropout_threshold(0.1) == 6554 and dropout_scale(0.1) == 2**16 / (2**16 - 6554)  # 1 / the keep probability
    assert dropout_threshold(1 - 2**-40) == 2**16 - 1  # some elements survive any p < 1
    assert check_dropout(0.0, None) == (0.0, None)
    assert check_dropout(0, (1, 2)) == (0.0, None)
    assert check_dropout(0.1, (3, 2**64 - 1)) == (0.1, (3, 2**64 - 1))
    for bad in (-0.1, 1.0, 1.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="dropout_p"):
            check_dropout(bad, (0, 0))
    with pytest.raises(TypeError, match="dropout_p"):
        check_dropout("0.1", (0, 0))
    with pytest.raises(ValueError, match="philox"):
        check_dropout(0.1, None)
    with pytest.raises(ValueError, match="seed"):
        check_dropout(0.1, (-1, 0))
    with pytest.raises(ValueError, match="offset"):
        check_dropout(0.1, (0, 2**64))


def _keep_elementwise(seed, offset, p, b, h, q, kv, H, Q):
    """The definition in philox.cuh, element by element on Python ints."""
    quad = ((b * H + h) * ((Q + 15) // 16 * 4) + (q // 16) * 4 + (q // 2) % 4) & 0xFFFFFFFF
    w = _philox_python([kv // 2, quad, offset & 0xFFFFFFFF, offset >> 32], [seed & 0xFFFFFFFF, seed >> 32], DROPOUT_ROUNDS)
    word = w[2 * (q % 2) + (q // 8) % 2]
    return (word >> 16 if kv % 2 else word & 0xFFFF) >= dropout_threshold(p)


def test_keep_mask_layout():
    seed, offset, p = 0x0123456789ABCDEF, 0xFEDCBA9876543210, 0.3
    B, H, Q, KV = 2, 3, 37, 5  # (rows past 8 and 16: the second half and the next block of the quads)
    mask = dropout_keep_mask(seed, offset, B, H, Q, KV, p)
    assert mask.shape == (B, H, Q, KV) and mask.dtype == torch.bool
    for b in range(B):
        for h in range(H):
            for q in range(Q):
                for kv in range(KV):
                    assert bool(mask[b, h, q, kv]) == _keep_elementwise(seed, offset, p, b, h, q, kv, H, Q)


def test_keep_mask_statistics_and_streams():
    m = dropout_keep_mask(7, 0, 2, 4, 256, 256, 0.2)
    assert abs(m.float().mean().item() - 0.8) < 0.01
    # Any of seed, offset changes the whole mask; rows and columns are not copies of each other.
    for other in (dropout_keep_mask(8, 0, 2, 4, 256, 256, 0.2), dropout_keep_mask(7, 1, 2, 4, 256, 256, 0.2)):
        assert 0.25 < (m != other).float().mean().item() < 0.4  # about 2 p (1 - p) = 0.32
    assert not torch.equal(m[0, 0, 0], m[0, 0, 1]) and not torch.equal(m[0, 0, :, 0], m[0, 0, :, 1])
    assert not torch.equal(m[0, 0], m[0, 1]) and not torch.equal(m[0], m[1])
    assert torch.equal(m, dropout_keep_mask(7, 0, 2, 4, 256, 256, 0.2))
    assert dropout_keep_mask(7, 0, 1, 1, 64, 64, 0.0).all()


# ---------------------------------------------------------------- the CUDA header, on the host

HARNESS = r"""
#include <cstdio>
#include "philox.cuh"
// stdin lines: "P rounds c0 c1 c2 c3 k0 k1" -> four words (rounds 7 or 10); "G seed offset threshold B H Q KV" -> the
// keep bits.
int main() {
    char op;
    while (std::scanf(" %c", &op) == 1) {
        if (op == 'P') {
            unsigned c[4], k[2];
            int rounds;
            std::scanf("%d %u %u %u %u %u %u", &rounds, &c[0], &c[1], &c[2], &c[3], &k[0], &k[1]);
            const PhiloxWords w = rounds == 10 ? philox4x32<10>(c[0], c[1], c[2], c[3], k[0], k[1])
                                               : philox4x32<7>(c[0], c[1], c[2], c[3], k[0], k[1]);
            std::printf("%u %u %u %u\n", w.w[0], w.w[1], w.w[2], w.w[3]);
        } else {
            unsigned long long seed, offset;
            unsigned threshold;
            int B, H, Q, KV;
            std::scanf("%llu %llu %u %d %d %d %d", &seed, &offset, &threshold, &B, &H, &Q, &KV);
            for (int b = 0; b < B; ++b)
                for (int h = 0; h < H; ++h)
                    for (int q = 0; q < Q; ++q)
                        for (int kv = 0; kv < KV; ++kv)
                            std::putchar(dropout_keep(seed, offset, threshold, b, h, q, kv, H, Q) ? '1' : '0');
            std::putchar('\n');
        }
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def host_harness(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    d = tmp_path_factory.mktemp("philox_host")
    (d / "harness.cpp").write_text(HARNESS)
    exe = d / "harness"
    subprocess.run([cxx, "-std=c++17", "-O2", "-Wall", "-Werror", "-Wno-unknown-pragmas", f"-I{HEADER_DIR}", str(d / "harness.cpp"), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    return exe


def test_header_on_host_matches_torch(host_harness):
    rng = random.Random(1)
    counters = [[rng.getrandbits(32) for _ in range(4)] for _ in range(500)] + [list(c) for c, _, _ in KAT]
    keys = [[rng.getrandbits(32), rng.getrandbits(32)] for _ in range(500)] + [list(k) for _, k, _ in KAT]
    grids = [(rng.getrandbits(64), rng.getrandbits(64), p, 2, 3, q, kv)
             for p, q, kv in ((0.1, 9, 13), (0.5, 16, 16), (0.9, 1, 7), (0.3, 33, 64))]
    rounds = [10 if i % 2 else 7 for i in range(len(counters))]
    lines = [f"P {r} {' '.join(map(str, c + k))}" for r, c, k in zip(rounds, counters, keys)]
    lines += [f"G {s} {o} {dropout_threshold(p)} {B} {H} {Q} {KV}" for s, o, p, B, H, Q, KV in grids]
    out = subprocess.run([str(host_harness)], input="\n".join(lines) + "\n", capture_output=True, text=True, check=True)
    got = out.stdout.split("\n")
    want = [philox4x32(torch.tensor(c), torch.tensor(k), r).tolist() for r, c, k in zip(rounds, counters, keys)]
    assert [list(map(int, line.split())) for line in got[: len(want)]] == want
    for line, (s, o, p, B, H, Q, KV) in zip(got[len(want):], grids):
        ref = dropout_keep_mask(s, o, B, H, Q, KV, p).flatten().tolist()
        assert line == "".join("1" if x else "0" for x in ref), (s, o, p, Q, KV)


# ---------------------------------------------------------------- only dropout kernels carry dropout code


@pytest.mark.parametrize("kind", ["fwd", "bwd"])
def test_dropout_code_only_with_spec_dropout(kind):
    plain = emit(kind, None, None, head_dim=64, arch="sm_90a")
    with_dropout = emit(kind, None, None, head_dim=64, arch="sm_90a", dropout=True)
    for word in ("philox", "dropout"):
        assert word not in plain.lower()
        assert word in with_dropout
    assert "dropout_keep_bits" in with_dropout


@pytest.mark.parametrize("bad", [-0.5, 1.0, float("nan")])
def test_calls_reject_bad_dropout_before_any_kernel(bad):
    from flexgen.runtime.forward import forward_call
    from flexgen.runtime.backward import backward_call

    q = torch.zeros(1, 1, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="0 <= dropout_p < 1"):
        forward_call(q, q, q, None, None, None, 0.125, None, dropout_p=bad, philox=(0, 0))
    with pytest.raises(ValueError, match="0 <= dropout_p < 1"):
        backward_call(q, q, q, q, q[..., 0].float(), q, None, None, None, 0.125, None, (True,) * 3,
                      dropout_p=bad, philox=(0, 0))
    with pytest.raises(ValueError, match="philox"):
        forward_call(q, q, q, None, None, None, 0.125, None, dropout_p=0.1)


def test_dropout_tiles():
    """Dropout kernels get their own tile where the default sits at the register limit: sm80's lean rows, and on sm90
    the two-warpgroup tiles instead of the 128-row D = 64 backward, and of the 192-row forward beside a score_mod."""
    from flexgen.codegen.api import make_spec

    sm80 = {"family": "sm80"}
    plain = make_spec("fwd", head_dim=128, arch="sm_90a", **sm80)
    dropped = make_spec("fwd", head_dim=128, arch="sm_90a", dropout=True, **sm80)
    assert (dropped.block_m, dropped.block_n) == (plain.block_m, plain.block_n)  # block masks fit both alike
    assert dropped.num_warps == 8 and dropped.dropout and not plain.dropout
    at_64 = make_spec("fwd", head_dim=64, arch="sm_90a", **sm80)
    assert make_spec("fwd", head_dim=64, arch="sm_90a", dropout=True, **sm80) == at_64.with_(dropout=True)  # fits
    assert make_spec("fwd", head_dim=128, arch="sm_90a", dropout=True, num_warps=4).num_warps == 4  # overrides win
    spec = make_spec("bwd", head_dim=64, arch="sm_90a", dropout=True)
    assert (spec.family, spec.block_m, spec.block_n, spec.num_warps) == ("sm90", 64, 128, 8)
    assert make_spec("bwd", head_dim=64, arch="sm_90a").block_m != spec.block_m
    assert make_spec("fwd", head_dim=64, arch="sm_90a", dropout=True) == make_spec("fwd", head_dim=64,
                                                                                 arch="sm_90a").with_(dropout=True)
    scored = make_spec("fwd", "score * 0.5", head_dim=64, arch="sm_90a", dropout=True)
    assert (scored.family, scored.block_m, scored.num_warps) == ("sm90", 128, 8)
