"""Compile-only check of the CUDA kernels (runs wherever nvcc is on PATH, no GPU needed)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parent.parent / "csrc"

# The defines torch.utils.cpp_extension passes to nvcc, so that this check
# compiles the kernels the way the JIT build does.
TORCH_NVCC_FLAGS = [
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr",
]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.timeout(300)
def test_kernels_compile_for_sm90(tmp_path):
    out = tmp_path / "moe_a2a.o"
    cmd = ["nvcc", "-arch=sm_90", "-std=c++17", *TORCH_NVCC_FLAGS, "-c", str(CSRC / "moe_a2a.cu"), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    assert out.stat().st_size > 0


def test_kernel_sources_include_no_torch():
    """The kernels compile with plain nvcc: only bindings.cpp may include torch."""
    for name in ("moe_a2a.cu", "moe_a2a.cuh"):
        text = (CSRC / name).read_text()
        for banned in ("<torch/", "<ATen/", "<c10/"):
            assert banned not in text, f"{name} includes {banned}"
