"""The small-T table against FlashInfer (a2ad.bench.small_t), from harness logs as the GPU
machine printed them (one H200, hidden 2880; the rows are that run's, cut to T = 1, 8 and
4096, with a FlashInfer point that did not finish added in the form fi_timing prints)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from a2ad.bench import small_t as S

A2AD_LOG = """\
default                                        T=1     diag=0  flush=1  dispatch     9.95 us (9.15-10.37)  combine     8.10 us (7.46-8.70)

hidden 2880, top_k 8, 256 experts, 2 ranks all on cuda:0 (--one-gpu)

| stage | T | diag | L2 flush | dispatch us (p10-p90) | combine us (p10-p90) |
| --- | --: | --: | --: | --: | --: |
| default | 1 | 0 | yes | 9.95 (9.15-10.37) | 8.10 (7.46-8.70) |
| fp8 combine (low_precision) | 1 | 0 | yes | 9.98 (9.18-10.34) | 8.16 (7.62-8.77) |
| default | 8 | 0 | yes | 11.01 (10.30-11.62) | 9.25 (8.51-10.18) |
| fp8 combine (low_precision) | 8 | 0 | yes | 11.10 (10.30-11.62) | 8.93 (8.42-9.57) |
| default | 4096 | 0 | yes | 58.18 (57.38-59.62) | 79.58 (78.43-80.48) |
| fp8 combine (low_precision) | 4096 | 0 | yes | 58.11 (57.09-59.58) | 78.11 (76.26-79.33) |

| T | bf16 combine us | fp8 combine us | fp8 / bf16 |
| --: | --: | --: | --: |
| 1 | 8.10 | 8.16 | 1.007 |
"""

FI_LOG = """\
flashinfer combine=bf16      T=1     hidden=2880  dispatch    11.58 us (10.85-12.29)  combine     9.70 us (9.18-10.08)

top_k 8, 256 experts, 2 ranks both on cuda:0, FlashInfer's kernels

| impl | T | hidden | dispatch us (p10-p90) | combine us (p10-p90) |
| --- | --: | --: | --: | --: |
| flashinfer combine=bf16 | 1 | 2880 | 11.58 (10.85-12.29) | 9.70 (9.18-10.08) |
| flashinfer combine=fp8 | 1 | 2880 | 11.84 (11.07-12.54) | 9.25 (8.64-9.60) |
| flashinfer combine=bf16 | 8 | 2880 | 11.87 (11.10-12.42) | 10.37 (9.79-10.72) |
| flashinfer combine=fp8 | 8 | 2880 | 11.71 (10.91-12.35) | 9.44 (8.80-9.92) |
| flashinfer combine=bf16 | 32 | 2880 | did not finish in 15 s (both ranks' grids not resident at once?) | |
"""


def _run(tmp_path, a2ad_logs: list[str], fi_logs: list[str]) -> subprocess.CompletedProcess:
    args = []
    for i, text in enumerate(a2ad_logs):
        (tmp_path / f"kt{i}.log").write_text(text)
        args.append(str(tmp_path / f"kt{i}.log"))
    args.append("--flashinfer")
    for i, text in enumerate(fi_logs):
        (tmp_path / f"fi{i}.log").write_text(text)
        args.append(str(tmp_path / f"fi{i}.log"))
    return subprocess.run([sys.executable, "-m", "a2ad.bench.small_t", *args], capture_output=True, text=True,
                          timeout=60)


def test_the_table_gives_flashinfer_over_a2ad_for_each_kernel_and_the_lowest(tmp_path):
    r = _run(tmp_path, [A2AD_LOG], [FI_LOG])
    assert r.returncode == 0, r.stderr
    rows = {line.split(" | ")[0] + " | " + line.split(" | ")[1]: line for line in r.stdout.splitlines()
            if line.startswith("| ") and line.split(" | ")[1].isdigit()}
    # dispatch from each side's bf16 run; FP8 combine against FlashInfer's FP8 combine
    assert rows["| 1 | 2880"] == ("| 1 | 2880 | 9.95 / 8.10 / 8.16 | 11.58 / 9.70 / 9.25 | 1.16 | 1.20 | 1.13 "
                                  "| 1 / 1 |")
    assert rows["| 8 | 2880"] == ("| 8 | 2880 | 11.01 / 9.25 / 8.93 | 11.87 / 10.37 / 9.44 | 1.08 | 1.12 | 1.06 "
                                  "| 1 / 1 |")
    # T=4096 (a2ad only) and T=32 (FlashInfer's did not finish) are not compared
    assert set(rows) == {"| 1 | 2880", "| 8 | 2880"}
    assert "lowest FlashInfer / a2ad: 1.06 (FP8 combine, hidden 2880, T=8)" in r.stdout
    assert "T=1, hidden 2880: dispatch 9.95 us, bf16 combine 8.10 us, FP8 combine 8.16 us" in r.stdout


def test_runs_of_one_point_count_as_their_mean(tmp_path):
    second = A2AD_LOG.replace("| default | 1 | 0 | yes | 9.95 (9.15-10.37) | 8.10 (7.46-8.70) |",
                              "| default | 1 | 0 | yes | 10.35 (9.15-10.77) | 8.30 (7.46-8.70) |")
    r = _run(tmp_path, [A2AD_LOG, second], [FI_LOG])
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("| 1 | 2880"))
    assert line == "| 1 | 2880 | 10.15 / 8.20 / 8.16 | 11.58 / 9.70 / 9.25 | 1.14 | 1.18 | 1.13 | 2 / 1 |"


def test_a_log_that_names_its_build_reads_the_same():
    """kernel_timing names the build on the job's line (``--production`` or the timing build)."""
    for build in ("production", "timing"):
        named = A2AD_LOG.replace("2 ranks all on cuda:0 (--one-gpu)", f"2 ranks all on cuda:0 (--one-gpu), {build} build")
        assert named != A2AD_LOG
        assert S.parse_a2ad(named) == S.parse_a2ad(A2AD_LOG)


def test_diagnostic_rows_are_not_the_kernels_as_they_serve():
    text = A2AD_LOG.replace("| default | 8 | 0 | yes |", "| diag publish, no wait | 8 | 4 | yes |")
    points, _ = S.parse_a2ad(text)
    assert S.DISPATCH not in points[(2880, 8)] and points[(2880, 8)][S.FP8] == [8.93]
    # a diagnostic row under the label "default" is left out too
    points, _ = S.parse_a2ad(A2AD_LOG.replace("| default | 8 | 0 | yes |", "| default | 8 | 4 | yes |"))
    assert S.DISPATCH not in points[(2880, 8)]


@pytest.mark.parametrize("a2ad, fi, says", [
    (A2AD_LOG.replace("2 ranks all on cuda:0 (--one-gpu)", "2 ranks on cuda:0 .. cuda:1"), FI_LOG,
     "only a kernel_timing --one-gpu run of two ranks compares"),
    (A2AD_LOG.replace("2 ranks all on cuda:0 (--one-gpu)", "4 ranks all on cuda:0 (--one-gpu)"), FI_LOG,
     "a run of 4 ranks"),
    (A2AD_LOG, FI_LOG.replace("top_k 8, 256", "top_k 4, 256"), "not the same job"),
    (A2AD_LOG.replace("hidden 2880, top_k", "hidden 7168, top_k"), FI_LOG, "no (hidden, T) measured by both sides"),
    ("Traceback (most recent call last):\nRuntimeError: CUDA error\n", FI_LOG, "no table rows of kernel_timing"),
    (A2AD_LOG, "fi_timing: FlashInfer is not importable (ModuleNotFoundError)\n", "no table of fi_timing"),
])
def test_logs_that_do_not_compare_are_refused_with_the_reason(tmp_path, a2ad, fi, says):
    r = _run(tmp_path, [a2ad], [fi])
    assert r.returncode == 2 and r.stdout == ""
    assert says in r.stderr, r.stderr


def test_logs_of_different_jobs_on_one_side_are_refused(tmp_path):
    other = A2AD_LOG.replace("top_k 8, 256 experts", "top_k 4, 256 experts")
    r = _run(tmp_path, [A2AD_LOG, other], [FI_LOG])
    assert r.returncode == 2 and "logs of different jobs on one side" in r.stderr
