"""benchmarks/kernel_ab.py: launches mapped to cases by order, the compile launch left out, medians per tree."""
from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "kernel_ab.py"
HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def ncu_csv(cases: dict[str, list[float]], launches: int = 4, kernels=("flexgen_bwd",), shares=None) -> str:
    """ncu --csv output as the device writes it: the program's CASE lines first, then one row per kernel launched
    (`kernels` per call, each taking its share of the call's time: `shares`, else equal ones)."""
    shares = shares or [1 / len(kernels)] * len(kernels)
    lines = ["==PROF== Connected to process 1 (/usr/bin/python3)"] + [f"CASE {c}" for c in cases] + [HEADER]
    launch = 0
    for times in cases.values():
        assert len(times) == launches
        for ns in times:
            for name, share in zip(kernels, shares):
                lines.append(f'"{launch}","1","python3","127.0.0.1","{name}","1","7","(384, 1, 1)","(132, 1, 1)",'
                             f'"0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns",'
                             f'"{ns * share:,.0f}"')
                launch += 1
    return "\n".join(lines) + "\n"


def report(folder: Path) -> list[str]:
    out = subprocess.run([sys.executable, str(SCRIPT), "report", str(folder)], capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def test_medians_per_tree_against_the_baseline_without_the_first_launch(tmp_path):
    rng = random.Random()
    # (whole ns, as ncu writes them, so that the baseline printed is not off by a rounding)
    base_full, base_causal = float(rng.randrange(1_000_000, 5_000_000)), float(rng.randrange(500_000, 1_000_000))
    for r in (1, 2):
        # the first launch of each case (the one after the compile) is slow and must not count
        (tmp_path / f"ncu_base_r{r}.csv").write_text(ncu_csv({"128 full": [9e9, base_full, base_full, base_full],
                                                              "128 causal": [9e9] + [base_causal] * 3}))
        (tmp_path / f"ncu_this_r{r}.csv").write_text(ncu_csv({"128 full": [9e9] + [base_full * 0.98] * 3,
                                                              "128 causal": [9e9] + [base_causal * 1.05] * 3}))
    (tmp_path / "trees.txt").write_text("base this\n")
    lines = report(tmp_path)
    assert lines[0] == "| case | base | this |"
    full = next(line for line in lines if line.startswith("| 128 full |"))
    causal = next(line for line in lines if line.startswith("| 128 causal |"))
    assert f"{base_full / 1e3:.1f} us (+0.0%, spread 0.0%, n=6)" in full
    assert "(-2.0%, spread 0.0%, n=6)" in full
    assert "(+5.0%, spread 0.0%, n=6)" in causal


def test_a_launch_count_that_does_not_match_the_cases_is_an_error(tmp_path):
    text = ncu_csv({"128 full": [1e6] * 4, "64 causal": [1e6] * 4})
    dropped = "\n".join(line for line in text.splitlines() if not line.startswith('"7"')) + "\n"
    (tmp_path / "ncu_base_r1.csv").write_text(dropped)
    out = subprocess.run([sys.executable, str(SCRIPT), "report", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode != 0 and "7 kernel launches for 2 cases; expected 4 each" in out.stderr


@pytest.mark.parametrize("tree", ["no-equals", "bad label=.", "x=/nonexistent"])
def test_run_refuses_a_malformed_tree(tree, tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "run", "--kind", "fwd", "--tree", tree, "--out", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "expected LABEL=DIR" in out.stderr


def test_cases_run_the_harness_variants_in_order(capsys):
    """`cases` on the CPU (flexgen's unfused path, a short sequence): every case of both kinds runs and announces
    itself in CASES order, which is what `report` maps ncu's launches by."""
    sys.path.insert(0, str(SCRIPT.parent))
    import kernel_ab

    for kind in ("fwd", "bwd"):
        kernel_ab.run_cases(kind, n=128, heads=2, tokens=128, device="cpu")
        announced = [line[len("CASE "):] for line in capsys.readouterr().out.splitlines() if line.startswith("CASE ")]
        # (a length other than the default 8k is part of each case's name, so that runs at two lengths never mix)
        assert announced == [f"{d} {name} N=128" for d, name in kernel_ab.CASES[kind]]


def test_only_runs_the_named_cases_in_cases_order_then_the_others(capsys):
    sys.path.insert(0, str(SCRIPT.parent))
    import kernel_ab

    kernel_ab.run_cases("fwd", n=128, heads=2, tokens=128, device="cpu", only="256:full, 64:causal, 128:full")
    announced = [line[len("CASE "):] for line in capsys.readouterr().out.splitlines() if line.startswith("CASE ")]
    assert announced == ["128 full N=128", "64 causal N=128", "256 full N=128"]  # (cases past CASES: as given)
    with pytest.raises(SystemExit, match="HEAD_DIM:VARIANT"):
        kernel_ab.selected("fwd", "64-causal")


def test_the_whole_backward_sums_its_three_kernels_per_call(tmp_path):
    """bwd_all times preprocess, main kernel and postprocess: each call's three launches are one sample."""
    rng = random.Random()
    # (a multiple of 30 ns: each kernel's third of `full` and of 1.1 `full` is a whole ns, as ncu writes them, so the
    # sums printed are exact rather than off by a rounding)
    full = 30.0 * rng.randrange(4_000_000 // 30, 6_000_000 // 30)
    three = ("flexgen_bwd_preprocess", "flexgen_bwd", "flexgen_bwd_postprocess")
    (tmp_path / "ncu_base_r1.csv").write_text(ncu_csv({"128 full": [9e9] + [full] * 3}, kernels=three))
    (tmp_path / "ncu_this_r1.csv").write_text(ncu_csv({"128 full": [9e9] + [full * 1.1] * 3}, kernels=three))
    (tmp_path / "trees.txt").write_text("base this\n")
    line = next(line for line in report(tmp_path) if line.startswith("| 128 full |"))
    assert f"{full / 1e3:.1f} us (+0.0%, spread 0.0%, n=3)" in line and "(+10.0%" in line


def test_the_whole_backward_also_reports_each_kernel(tmp_path):
    """With several kernels per call, a second table gives each kernel's medians: a change in the main kernel alone
    shows there, diluted in the sums."""
    rng = random.Random()
    three = ("flexgen_bwd_preprocess", "flexgen_bwd", "flexgen_bwd_postprocess")
    main_ns = 1000.0 * rng.randrange(2_000, 5_000)
    base = {"96 causal": [9e9] + [main_ns * 1.2] * 3}
    this = {"96 causal": [9e9] + [main_ns * 1.25] * 3}  # the main kernel 5% slower, the others unchanged
    (tmp_path / "ncu_base_r1.csv").write_text(ncu_csv(base, kernels=three, shares=[0.1 / 1.2, 1 / 1.2, 0.1 / 1.2]))
    (tmp_path / "ncu_this_r1.csv").write_text(ncu_csv(this, kernels=three, shares=[0.1 / 1.25, 1.05 / 1.25, 0.1 / 1.25]))
    (tmp_path / "trees.txt").write_text("base this\n")
    lines = report(tmp_path)
    assert "By kernel:" in lines
    by = {line.split(" | ")[0]: line for line in lines if line.startswith("| 96 causal: ")}
    assert set(by) == {f"| 96 causal: {name}" for name in three}
    assert f"{main_ns / 1e3:.1f} us (+0.0%" in by["| 96 causal: flexgen_bwd"] and "(+5.0%" in by["| 96 causal: flexgen_bwd"]
    assert "(+0.0%, spread 0.0%, n=3) | " in by["| 96 causal: flexgen_bwd_preprocess"]
    assert by["| 96 causal: flexgen_bwd_postprocess"].endswith("(+0.0%, spread 0.0%, n=3) |")


def test_each_tree_takes_each_place_in_the_order_once_over_as_many_rounds(tmp_path, monkeypatch):
    """A fixed order biased the later trees (docs/backward.md, v37): `run` rotates it from round to round."""
    sys.path.insert(0, str(SCRIPT.parent))
    import kernel_ab

    started = []

    def fake_run(cmd, cwd, env, stdout, stderr, timeout):
        started.append(Path(cwd).name)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(kernel_ab.subprocess, "run", fake_run)
    names = ["base", "same", "new", "other"][: random.randrange(2, 5)]
    trees = []
    for name in names:
        (tmp_path / name).mkdir()
        trees.append((name, tmp_path / name))
    kernel_ab.run("fwd", trees, len(names), tmp_path / "out", timeout_s=1.0)
    rounds = [started[i:i + len(names)] for i in range(0, len(started), len(names))]
    assert len(rounds) == len(names) and all(sorted(r) == sorted(names) for r in rounds)
    for place in range(len(names)):
        assert sorted(r[place] for r in rounds) == sorted(names)  # every tree once in every place
    assert rounds[0] == names  # (the first round in the order given)
