"""The FlashInfer one-GPU timing harness: its argument checks here; its timings on the GPU machine."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "a2ad.bench.fi_timing", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("bad", [["--tokens", "0"], ["--tokens", "a,b"], ["--hidden", ""]])
def test_fi_timing_refuses_bad_grids(bad):
    cp = _run(*bad)
    assert cp.returncode == 2
    assert "--tokens" in cp.stderr or "--hidden" in cp.stderr


@pytest.mark.gpu
def test_fi_timing_times_flashinfer_at_t1_or_says_why(tmp_path):
    """On the GPU machine: with FlashInfer importable a row per configuration, else exit 2 naming it."""
    cp = _run("--tokens", "1", "--hidden", "2880", "--low-precision", "off", "--limit", "90")
    if cp.returncode == 2:
        assert "FlashInfer is not importable" in cp.stderr
        pytest.skip("flashinfer is not importable here")
    assert cp.returncode == 0, cp.stderr
    assert "| flashinfer combine=bf16 | 1 | 2880 |" in cp.stdout
