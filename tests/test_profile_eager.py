"""scripts/profile-eager.py and scripts/eager-ab.py (two trees' eager pairs in turn), the eager
host cost of a dispatch + combine pair: run for real (each job on its own daemon, one rank, real
pairs), on the host backend here and on CUDA where there is a GPU; their figures parsed from
what they print; bad arguments refused before anything starts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "profile-eager.py"

PAIR = re.compile(r"one rank, T=(\d+), hidden=(\d+), top_k=(\d+), backend (\w+): eager pair ([\d.]+) us "
                  r"\(host issue ([\d.]+) us\), (.*)$", re.M)
REFERENCE = re.compile(r"reference \(two in-place torch ops on a \[(\d+), (\d+)\] bf16 tensor of the pair's device\): "
                       r"([\d.]+) us; eager pair / reference ([\d.]+) \(median of (\d+) batches; "
                       r"batch ratios ([\d.]+)-([\d.]+)\)")


def run(*args, timeout=180):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=str(REPO))


def figures(p):
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    pair, ref = PAIR.search(p.stdout), REFERENCE.search(p.stdout)
    assert pair and ref, p.stdout[-3000:]
    return pair.groups(), ref.groups()


def check_reference(ref, tokens, hidden, batches):
    rows, cols, ref_us, ratio, n, lo, hi = ref
    assert (int(rows), int(cols), int(n)) == (tokens, hidden, batches)
    assert float(ref_us) > 0
    assert 0 < float(lo) <= float(ratio) <= float(hi)  # the median lies within the batches' ratios


def test_the_host_backend_pair_is_timed_beside_its_reference_and_profiled():
    p = run("--backend", "host", "--tokens", "2", "--hidden", "256", "--top-k", "4", "--experts", "16",
            "--pairs", "300", "--batches", "3")
    pair, ref = figures(p)
    assert pair[:4] == ("2", "256", "4", "host")
    eager, host = float(pair[4]), float(pair[5])
    assert eager > 0 and host > 0
    assert pair[6] == "no graph replay (host backend)"
    check_reference(ref, 2, 256, 3)
    # the cProfile of the 300 eager pairs, by own time: many calls a pair
    calls = re.search(r"(\d+) function calls (?:\(\d+ primitive calls\) )?in ([\d.]+) seconds", p.stdout)
    assert calls and int(calls.group(1)) > 300, p.stdout[-3000:]  # more than one call a pair
    assert "Ordered by: internal time" in p.stdout


def test_without_the_profile_only_the_figures_are_printed():
    p = run("--backend", "host", "--hidden", "128", "--top-k", "2", "--experts", "8", "--pairs", "40",
            "--batches", "40", "--no-profile")
    _, ref = figures(p)
    check_reference(ref, 1, 128, 40)
    assert "function calls in" not in p.stdout


@pytest.mark.parametrize("args, message", [
    (["--pairs", "5", "--batches", "6"], "--batches (6) must not exceed --pairs (5)"),
    (["--pairs", "0"], "must be at least 1, got 0"),
    (["--top-k", "9", "--experts", "8"], "--top-k (9) must not exceed --experts (8)"),
    (["--backend", "nvlink"], "invalid choice: 'nvlink'"),
])
def test_bad_arguments_are_refused_before_a_daemon_starts(args, message):
    p = run("--backend", "host", *args, timeout=60)  # (a later --backend overrides this one)
    assert p.returncode == 2, p.stdout + p.stderr
    assert message in p.stderr, p.stderr
    assert "eager pair" not in p.stdout


@pytest.mark.gpu
def test_the_cuda_pair_is_timed_eagerly_and_from_a_graph():
    p = run("--tokens", "1", "--hidden", "7168", "--pairs", "400", "--batches", "4", "--no-profile")
    pair, ref = figures(p)
    assert pair[:4] == ("1", "7168", "8", "cuda")
    graph = re.fullmatch(r"graph replay of the pair ([\d.]+) us, eager - graph ([+-][\d.]+) us", pair[6])
    assert graph, pair[6]
    eager, replay = float(pair[4]), float(graph.group(1))
    assert eager > 0 and replay > 0
    # the difference it prints is of the two it prints (each of the three rounded to 0.01)
    assert abs(eager - replay - float(graph.group(2))) <= 0.0151
    check_reference(ref, 1, 7168, 4)


AB = REPO / "scripts" / "eager-ab.py"
AB_HEAD = re.compile(r"eager pair, one rank, T=(\d+), hidden=(\d+), top_k=(\d+), backend (\w+): (\d+) rounds of "
                     r"(\d+) pairs a side, in turn, both main threads on CPU (\d+)")
AB_SIDE = re.compile(r"^([AB]) \((.*)\): ([\d.]+) us a pair \(median of rounds; p10-p90 ([\d.]+)-([\d.]+)\), "
                     r"pair / reference ([\d.]+)$", re.M)
AB_RATIO = re.compile(r"B / A: ([\d.]+) \(median of (\d+) rounds; p10-p90 ([\d.]+)-([\d.]+); "
                      r"B took longer in (\d+) of (\d+)\)")


def run_ab(*args, timeout=240):
    return subprocess.run([sys.executable, str(AB), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=str(REPO))


def test_two_sides_take_turns_on_one_cpu_and_their_ratio_is_printed():
    p = run_ab("--backend", "host", "--hidden", "256", "--top-k", "4", "--experts", "16", "--rounds", "4",
               "--pairs", "30", "--b-env", "A2AD_EAGER_AB_MARK=b")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    head = AB_HEAD.search(p.stdout)
    assert head and head.groups()[:6] == ("1", "256", "4", "host", "4", "30"), p.stdout
    assert int(head.group(7)) in os.sched_getaffinity(0)
    sides = AB_SIDE.findall(p.stdout)
    assert [s[:2] for s in sides] == [("A", "this environment"), ("B", "A2AD_EAGER_AB_MARK=b")], p.stdout
    for _, _, median, lo, hi, ratio in sides:
        assert 0 < float(lo) <= float(median) <= float(hi) and float(ratio) > 0
    ratio = AB_RATIO.search(p.stdout)
    assert ratio, p.stdout
    median, n, lo, hi, slower, of = ratio.groups()
    assert (int(n), int(of)) == (4, 4) and 0 <= int(slower) <= 4
    assert 0 < float(lo) <= float(median) <= float(hi)


def test_a_side_that_cannot_start_is_named_with_its_error(tmp_path):
    broken = tmp_path / "site" / "a2ad"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('this a2ad is broken on purpose')\n")
    p = run_ab("--backend", "host", "--hidden", "128", "--top-k", "2", "--experts", "8", "--rounds", "2",
               "--pairs", "5", "--b-env", f"PYTHONPATH={tmp_path / 'site'}")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "eager-ab: side B: its worker ended" in p.stderr and "ready" in p.stderr, p.stderr
    assert "this a2ad is broken on purpose" in p.stderr, p.stderr  # the worker's own error, passed on
    assert "B / A" not in p.stdout


@pytest.mark.parametrize("args, message", [
    (["--b-env", "NOEQUALS"], "expected K=V words, got 'NOEQUALS'"),
    (["--rounds", "0"], "must be at least 1, got 0"),
    (["--top-k", "9", "--experts", "8"], "--top-k (9) must not exceed --experts (8)"),
    (["--cpu", "100000"], "--cpu 100000 is not one this process may use"),
])
def test_bad_arguments_of_the_side_by_side_are_refused_before_anything_starts(args, message):
    p = run_ab("--backend", "host", *args, timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    assert message in p.stderr, p.stderr
    assert "eager pair" not in p.stdout


@pytest.mark.gpu
def test_two_cuda_sides_take_turns():
    p = run_ab("--tokens", "1", "--hidden", "7168", "--rounds", "4", "--pairs", "100", "--b-env", "A2AD_EAGER_AB_MARK=b")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    head = AB_HEAD.search(p.stdout)
    assert head and head.groups()[:6] == ("1", "7168", "8", "cuda", "4", "100"), p.stdout
    assert len(AB_SIDE.findall(p.stdout)) == 2, p.stdout
    ratio = AB_RATIO.search(p.stdout)
    assert ratio and ratio.group(2) == "4" and float(ratio.group(1)) > 0, p.stdout
