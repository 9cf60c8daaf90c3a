"""``python -m a2ad.bench.ll_timing``: DeepEP's low-latency pair against the token-major pair
on the same tokens. Without a GPU its ``--dry-run`` drives the same rounds on the host backend
(a real daemon, every rank in one process), each checked before it is timed."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

ROW = re.compile(r"^\| (\d+) \| (token-major \(MoeAlltoAll\)|low-latency \(deep_ep, (?:ops|kernels)\)) \| "
                 r"([\d.]+) \([\d.]+-[\d.]+\) \| ([\d.]+) \([\d.]+-[\d.]+\) \| ([\d.]+) \| ([\d.]+) \|$", re.M)


def _run(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "a2ad.bench.ll_timing", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("bad", [["--tokens", "0"], ["--tokens", "x"], ["--paths", "fast"], ["--ep", "1"],
                                 ["--num-experts", "15"], ["--fp8", "--hidden", "200"]])
def test_ll_timing_refuses_bad_arguments(bad):
    r = _run("--dry-run", *bad, timeout=60)
    assert r.returncode == 2 and "error:" in r.stderr, (bad, r.stderr)


def test_ll_timing_dry_run_checks_and_times_both_pairs():
    """Both pairs run at every T through the harness's real daemon, their outputs are checked
    (exact sums), and the table has a row per (T, pair) with the ratio to the token-major one."""
    r = _run("--dry-run", "--tokens", "1,3")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.count("checked: every pair's output as expected") == 2, r.stdout
    rows = ROW.findall(r.stdout)
    assert [(int(t), label.split()[0]) for t, label, *_ in rows] == [
        (1, "token-major"), (1, "low-latency"), (3, "token-major"), (3, "low-latency")], r.stdout
    for t, label, d, c, pair, ratio in rows:
        assert float(d) > 0 and float(c) > 0 and float(pair) > 0, r.stdout
        if label.startswith("token-major"):
            assert float(ratio) == 1.0
    assert "--dry-run: no figures" in r.stdout


@pytest.mark.gpu
@pytest.mark.timeout(400)
@pytest.mark.parametrize("path", ["kernels", "ops"])
def test_ll_timing_on_one_gpu(path):
    """On a GPU: the token-major pair and the low-latency pair with each path of its local
    steps, checked and timed in CUDA graphs at three T, none of them starved of queued work.
    At T=128 the kernels that follow a rank's dispatch and combine fill the GPU: with both
    ranks on one GPU they must not be scheduled while the kernel before them still waits for
    the other rank (the round then timed out)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    r = _run("--paths", path, "--tokens", "1,8,128", "--rounds", "10", "--chunks", "2", "--timeout", "20", timeout=380)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.count("checked: every pair's output as expected") == 3, r.stdout
    labels = [(int(t), label) for t, label, *_ in ROW.findall(r.stdout)]
    assert labels == [(T, lab) for T in (1, 8, 128) for lab in ("token-major (MoeAlltoAll)",
                                                                 f"low-latency (deep_ep, {path})")], r.stdout
