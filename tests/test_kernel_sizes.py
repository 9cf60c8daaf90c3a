"""scripts/kernel-sizes.py: the kernels' machine-code sizes read from nvcc's cubins (compiled
here where nvcc exists; no GPU needed)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "kernel-sizes.py"


def load_script():
    spec = importlib.util.spec_from_file_location("kernel_sizes", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_anonymous_namespace_gets_one_name_whatever_the_source_path():
    ks = load_script()
    a = "_ZN4a2ad44_GLOBAL__N__a317de03_11_dispatch_cu_5bf0e37b15dispatch_kernelILi1ELb0ELb1EEEvNS_14DispatchParamsE"
    b = "_ZN4a2ad44_GLOBAL__N__0c9e11aa_11_dispatch_cu_77d01f2e15dispatch_kernelILi1ELb0ELb1EEEvNS_14DispatchParamsE"
    na, nb = ks.normalized(a), ks.normalized(b)
    assert na == nb == "_ZN4a2ad12_GLOBAL__N_115dispatch_kernelILi1ELb0ELb1EEEvNS_14DispatchParamsE"
    plain = "_ZN4a2ad15launch_dispatchERKNS_14DispatchParamsEP11CUstream_st"
    assert ks.normalized(plain) == plain


def test_text_sections_refuses_what_is_not_a_64_bit_elf():
    ks = load_script()
    with pytest.raises(ValueError, match="ELF"):
        ks.text_sections(b"\x7fELF\x01\x01" + bytes(64))
    with pytest.raises(ValueError, match="ELF"):
        ks.text_sections(b"not an object file at all" + bytes(64))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_sizes_of_a_compiled_source_name_its_kernels():
    out = subprocess.run([sys.executable, str(SCRIPT), "--files", "sanitize.cu"], capture_output=True, text=True,
                         timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    rows = {line.split("|")[1].strip(" `"): int(line.split("|")[2]) for line in out.stdout.splitlines()
            if line.startswith("| `")}
    assert set(rows) == {"initialize_kernel", "sanitize_kernel"}, out.stdout
    for name, size in rows.items():
        assert size > 0 and size % 16 == 0, (name, size)  # sm_90 instructions are 16 bytes


def test_a_missing_source_is_a_clear_error(tmp_path):
    if shutil.which("nvcc") is None:
        out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 2 and "nvcc not found" in out.stderr
        return
    out = subprocess.run([sys.executable, str(SCRIPT), "--files", "nosuch.cu"], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 1 and "nosuch.cu: no such source" in out.stderr


LISTING = """\
//--------------------- .text._ZN4a2ad44_GLOBAL__N__a317de03_11_dispatch_cu_5bf0e37b6kernelEv --------------------------
	//## File "/src/dispatch.cu", line 10
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   MOV R2, R1 ;
	//## File "/src/primitives.cuh", line 141 inlined at "/src/dispatch.cu", line 12
        /*0020*/                   IMAD R3, R2, R2, RZ ;
	//## File "/src/primitives.cuh", line 7 inlined at "/src/launch.cuh", line 3
        /*0030*/                   EXIT ;
//--------------------- .text._ZN4a2ad5otherEv --------------------------
	//## File "/src/dispatch.cu", line 99
        /*0000*/                   EXIT ;
"""


def test_bytes_by_line_counts_each_instruction_at_its_line_in_the_source():
    ks = load_script()
    got = ks.bytes_by_line(LISTING, "dispatch.cu", "6kernel")
    assert got == {"_ZN4a2ad12_GLOBAL__N_16kernelEv": {10: 32, 12: 16, "launch.cuh:3": 16}}
    assert ks.bytes_by_line(LISTING, "dispatch.cu", "nosuch") == {}


def test_by_line_without_nvdisasm_says_what_it_needs(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc on this machine (the script stops at it first)")
    # a PATH holding nvcc but no nvdisasm
    (tmp_path / "nvcc").symlink_to(nvcc)
    out = subprocess.run([sys.executable, str(SCRIPT), "--files", "dispatch.cu", "--by-line", "dispatch_kernel"],
                         capture_output=True, text=True, timeout=60, check=False,
                         env={"PATH": str(tmp_path), "HOME": str(tmp_path)})
    assert out.returncode == 2 and "nvdisasm" in out.stderr, out.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("nvdisasm") is None, reason="needs nvcc and nvdisasm")
def test_by_line_names_the_lines_of_a_compiled_kernel():
    out = subprocess.run([sys.executable, str(SCRIPT), "--files", "sanitize.cu", "--by-line", "sanitize_kernel",
                          "--top", "3"], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    assert 1 <= len(rows) <= 3, out.stdout
    assert "`sanitize_kernel` (sanitize.cu, sm_90)" in out.stdout
