"""Compile-only check of the CUDA kernels (runs wherever nvcc is on PATH, no GPU needed)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from a2ad.client._ext import HEADERS, SOURCES

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


KERNEL_FILES = [n for n in SOURCES if n.endswith(".cu")]


def torch_cxx_std() -> str:
    """The C++ standard the installed torch builds extensions with: its headers refuse C++17
    from the releases that need C++20 (torch.utils.cpp_extension then passes -std=c++20 to the
    host compiler and to nvcc alike), so these checks compile with what the JIT build uses."""
    import torch.utils.cpp_extension as ce

    for d in ce.include_paths():
        aten = Path(d) / "ATen" / "ATen.h"
        if aten.is_file():
            return "c++20" if "C++20 or later" in aten.read_text() else "c++17"
    return "c++17"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("defines", [[], pytest.param(["-DA2AD_KERNEL_TIMING"], marks=pytest.mark.full),
                                     pytest.param(["-DA2AD_DEBUG_CHECKS"], marks=pytest.mark.full)],
                         ids=["production", "timing-build", "debug-build"])
def test_kernels_compile_for_sm90(tmp_path, defines):
    """Every kernel file compiles with plain nvcc, the production build, the timing build
    (diagnostics compiled in) and the debug build (the launchers' checks compiled in) alike;
    none spills registers in dispatch or combine."""
    cmd = ["nvcc", "-arch=sm_90", f"-std={torch_cxx_std()}", "-O3", "-Xptxas", "-v", *TORCH_NVCC_FLAGS, *defines, "-c",
           *[str(CSRC / n) for n in KERNEL_FILES]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=str(tmp_path))
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    for n in KERNEL_FILES:
        assert (tmp_path / (Path(n).stem + ".o")).stat().st_size > 0, n
    spills = [line for line in proc.stderr.splitlines() if "spill" in line and not line.strip().startswith("0 bytes")]
    assert not spills, "\n".join(spills)


def test_kernel_sources_include_no_torch():
    """The kernels compile with plain nvcc: only bindings.cpp may include torch."""
    for name in KERNEL_FILES + list(HEADERS):
        text = (CSRC / name).read_text()
        for banned in ("<torch/", "<ATen/", "<c10/"):
            assert banned not in text, f"{name} includes {banned}"


def test_no_kernel_variants_or_runtime_diagnostics_in_production_code():
    """One kernel per concern: no variant switches, and the diagnostics exist only in the
    timing build (every use goes through a check that is constant false otherwise)."""
    for name in KERNEL_FILES + list(HEADERS):
        text = (CSRC / name).read_text()
        assert "variant" not in text.lower(), f"{name} still mentions kernel variants"
        for line in text.splitlines():
            if "p.diag" in line and "kTimingBuild" not in line:
                raise AssertionError(f"{name}: diagnostics read outside the kTimingBuild guard: {line.strip()}")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.timeout(300)
def test_quantize_kernel_keeps_its_rounded_arithmetic(tmp_path):
    """The quantize kernel's device code does its scaling with round-to-nearest multiplies and
    reciprocals (mul.rn / rcp.rn). A wrapper that called itself instead of the intrinsic once
    compiled to a kernel with no arithmetic at all (undefined behaviour, folded away) whose
    outputs were never written: the PTX must hold the instructions."""
    ptx = tmp_path / "quantize.ptx"
    cmd = ["nvcc", "-arch=sm_90", f"-std={torch_cxx_std()}", "-O3", *TORCH_NVCC_FLAGS, "-ptx", str(CSRC / "quantize.cu"),
           "-o", str(ptx)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr
    text = ptx.read_text()
    assert "mul.rn.f32" in text and "rcp.rn.f32" in text


def _nvcc_include_dirs() -> list[str]:
    """The include folders nvcc passes to the host compiler (its ``-v`` INCLUDES line)."""
    proc = subprocess.run(["nvcc", "-v", "-E", "-x", "cu", "/dev/null", "-o", "/dev/null"], capture_output=True,
                          text=True, timeout=60)
    dirs = []
    for line in proc.stderr.splitlines():
        if "INCLUDES=" in line:
            dirs += [w[2:] for w in line.split("=", 1)[1].strip().strip('"').split() if w.startswith("-I")]
            dirs += [w.strip('"') for w in line.split("=", 1)[1].split() if w.strip('"').startswith("/")]
    return sorted(set(d.strip('"') for d in dirs))


@pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("g++") is None, reason="nvcc or g++ not on PATH")
@pytest.mark.timeout(300)
def test_bindings_compile_against_the_installed_torch(tmp_path):
    """bindings.cpp, the one file that includes torch, passes the C++ compiler's checks against
    the installed torch's headers and the CUDA runtime's, so a binding's type or signature
    error is found without a GPU. A CPU-only torch lacks one header generated for CUDA builds
    (c10/cuda/impl/cuda_cmake_macros.h); it is written here with the macro it holds."""
    import sysconfig

    import torch.utils.cpp_extension as ce

    inc = list(ce.include_paths())
    extra = tmp_path / "inc"
    if not any((Path(d) / "c10/cuda/impl/cuda_cmake_macros.h").is_file() for d in inc):
        (extra / "c10/cuda/impl").mkdir(parents=True)
        (extra / "c10/cuda/impl/cuda_cmake_macros.h").write_text("#define C10_CUDA_BUILD_SHARED_LIBS\n")
    cuda = _nvcc_include_dirs()
    assert cuda, "nvcc -v named no include folder"
    cmd = ["g++", f"-std={torch_cxx_std()}", "-fsyntax-only", "-w", "-DTORCH_EXTENSION_NAME=a2ad_check",
           "-DTORCH_API_INCLUDE_EXTENSION_H", f"-I{extra}", *[f"-I{d}" for d in inc + cuda],
           f"-I{sysconfig.get_paths()['include']}", str(CSRC / "bindings.cpp")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr[-6000:]}"
