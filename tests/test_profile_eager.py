"""scripts/profile-eager.py, the eager host cost of a dispatch + combine pair: run for real (its
own daemon, a one-rank job, real pairs), on the host backend here and on CUDA where there is a
GPU; its figures parsed from what it prints; bad arguments refused before anything starts."""

from __future__ import annotations

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
