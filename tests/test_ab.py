"""Builds side by side from kernel_timing logs (a2ad.bench.ab): per-build means and run-pair
differences, from logs in the form the harness prints (rows of a one-H100 run of 2026-12-07,
cut down and given other values where a case needs them)."""

from __future__ import annotations

import subprocess
import sys

from a2ad.bench import ab


def log(rows: list[tuple[int, float, float, float]], *, hidden: int = 2880, where: str = "all on cuda:0 (--one-gpu)",
        top_k: int = 8, experts: int = 256, flush: str = "yes") -> str:
    """A kernel_timing log of (T, dispatch, bf16 combine, FP8 combine) rows."""
    lines = [f"hidden {hidden}, top_k {top_k}, {experts} experts, 2 ranks {where}, timing build", "",
             "| stage | T | diag | L2 flush | dispatch us (p10-p90) | combine us (p10-p90) |",
             "| --- | --: | --: | --: | --: | --: |"]
    for T, d, c, f in rows:
        lines.append(f"| default | {T} | 0 | {flush} | {d:.2f} ({d - 1:.2f}-{d + 1:.2f}) | {c:.2f} ({c - 1:.2f}-{c + 1:.2f}) |")
        lines.append(f"| fp8 combine (low_precision) | {T} | 0 | {flush} | {d:.2f} (0.00-1.00) | {f:.2f} (0.00-1.00) |")
        # a diagnostic row: never counted
        lines.append(f"| diag no-op dispatch kernel (launch floor) | {T} | 16 | {flush} | 1.00 (0.90-1.10) | 2.00 (1.90-2.10) |")
    return "\n".join(lines) + "\n"


def _run(tmp_path, builds: dict[str, list[str]]) -> subprocess.CompletedProcess:
    args = []
    for name, texts in builds.items():
        args += ["--build", name]
        for i, text in enumerate(texts):
            p = tmp_path / f"{name}-{i}.log"
            p.write_text(text)
            args.append(str(p))
    return subprocess.run([sys.executable, "-m", "a2ad.bench.ab", *args], capture_output=True, text=True, timeout=60)


def test_means_and_run_pairs(tmp_path):
    base = [log([(1, 9.90, 8.30, 8.20), (4096, 68.40, 97.40, 90.40)]),
            log([(1, 10.10, 8.50, 8.40), (4096, 68.20, 97.60, 90.20)]),
            log([(1, 10.40, 8.70, 8.50)], hidden=7168)]
    new = [log([(1, 9.70, 8.40, 8.10), (4096, 68.50, 97.40, 90.30)]),
           log([(1, 9.80, 8.40, 8.50), (4096, 68.30, 97.60, 90.20)]),
           log([(1, 10.20, 8.60, 8.50)], hidden=7168)]
    res = _run(tmp_path, {"main": base, "new": new})
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "top_k 8, 256 experts, L2 flushed before each round" in out
    assert "| T | hidden | dispatch main | new | bf16 combine main | new | FP8 combine main | new |" in out
    assert "| 1 | 2880 | 10.00 | 9.75 | 8.40 | 8.40 | 8.30 | 8.30 |" in out
    assert "| 4096 | 2880 | 68.30 | 68.40 | 97.50 | 97.50 | 90.30 | 90.25 |" in out
    assert "| 1 | 7168 | 10.40 | 10.20 | 8.70 | 8.60 | 8.50 | 8.50 |" in out
    # run by run: 9.70-9.90 and 9.80-10.10; 8.40-8.30 and 8.40-8.50; 8.10-8.20 and 8.50-8.40
    assert "| 1 | 2880 | -0.25 (2 of 2) | +0.00 (1 of 2) | +0.00 (1 of 2) |" in out
    assert "| 4096 | 2880 | +0.10 (0 of 2) | +0.00 (0 of 2) | -0.05 (1 of 2) |" in out
    assert "| 1 | 7168 | -0.20 (1 of 1) | -0.10 (1 of 1) | +0.00 (0 of 1) |" in out
    assert "new against main, run by run" in out


def test_a_point_printed_twice_counts_once_and_uneven_runs_are_marked(tmp_path):
    # a --tokens 512,4096 run prints T = 4096 twice: that log's run is the mean of the two
    twice = log([(512, 17.00, 22.00, 22.50), (4096, 68.00, 97.00, 90.00), (4096, 69.00, 98.00, 91.00)])
    once = log([(4096, 67.00, 96.00, 89.00)])
    res = _run(tmp_path, {"a": [twice], "b": [once, once]})
    assert res.returncode == 0, res.stderr
    assert "| 4096 | 2880 | 68.50 (1) | 67.00 (2) | 97.50 (1) | 96.00 (2) | 90.50 (1) | 89.00 (2) |" in res.stdout
    assert "| 512 | 2880 | 17.00 (1) | - | 22.00 (1) | - | 22.50 (1) | - |" in res.stdout
    assert "| 4096 | 2880 | -1.50 (1 of 1) | -1.50 (1 of 1) | -1.50 (1 of 1) |" in res.stdout  # paired: run 1 only
    assert "| 512 | 2880 | - | - | - |" in res.stdout


def test_runs_of_other_shapes_than_flashinfer_compares_are_read():
    # (small_t refuses these: FlashInfer's figures are of two ranks on one GPU)
    pts, shape = ab.runs([("x", log([(8, 11.0, 9.0, 8.5)], where="on cuda:0, cuda:1"))])
    assert shape == (8, 256, True)
    assert pts == {(2880, 8): {"dispatch": [11.0], "bf16 combine": [9.0], "FP8 combine": [8.5]}}


def test_refusals(tmp_path):
    one = log([(1, 9.9, 8.3, 8.2)])
    res = _run(tmp_path, {"only": [one]})
    assert res.returncode == 2 and "at least two builds" in res.stderr
    res = _run(tmp_path, {"a": [one], "b": [log([(1, 9.9, 8.3, 8.2)], top_k=4)]})
    assert res.returncode == 2 and "another job shape" in res.stderr
    res = _run(tmp_path, {"a": [one], "b": [one, log([(1, 9.9, 8.3, 8.2)], flush="no")]})
    assert res.returncode == 2 and "L2 flush" in res.stderr
    res = _run(tmp_path, {"a": [one], "b": ["no table here\n"]})
    assert res.returncode == 2 and "no table rows of kernel_timing" in res.stderr
    res = subprocess.run([sys.executable, "-m", "a2ad.bench.ab", "--build", "a", "--build", "b", "x.log"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "build 'a': no logs" in res.stderr
    res = subprocess.run([sys.executable, "-m", "a2ad.bench.ab", "x.log"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "expected --build NAME" in res.stderr
