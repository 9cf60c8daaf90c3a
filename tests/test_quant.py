"""Quantized combine outputs on the host: the reference quantizer against values computed by
hand from the OCP MX / NVFP4 definitions, and the production quantizer against the
reference, bit for bit, for every format, layout and input dtype."""

from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from a2ad import errors
from a2ad.client import quant
from a2ad.client import quant_reference as ref

from _quant_cases import FORMATS, LAYOUTS, REF_LAYOUT, nvfp4_scale, random_input

NAN, INF = float("nan"), float("inf")


# --- the element types ---------------------------------------------------------------------

def test_element_tables():
    assert [ref.e2m1_value(c) for c in range(8)] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert ref.e2m1_value(0xF) == -6.0
    assert ref.e4m3_value(0x7E) == 448.0
    assert ref.e4m3_value(0x01) == 2.0 ** -9  # smallest subnormal
    assert ref.e4m3_value(0x08) == 2.0 ** -6  # smallest normal
    assert ref.e4m3_value(0x38) == 1.0
    assert math.isnan(ref.e4m3_value(0x7F)) and math.isnan(ref.e4m3_value(0xFF))
    # every code decodes to what torch's float8_e4m3fn says
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    torch_vals = codes.view(torch.float8_e4m3fn).to(torch.float64).tolist()
    for c, tv in enumerate(torch_vals):
        v = ref.e4m3_value(c)
        assert (math.isnan(v) and math.isnan(tv)) or v == tv, c


def test_element_rounding():
    # round to nearest, ties to the even code
    assert ref.e2m1_encode(0.25) == 0 and ref.e2m1_encode(0.2500001) == 1
    assert ref.e2m1_encode(0.75) == 2 and ref.e2m1_encode(1.25) == 2 and ref.e2m1_encode(1.75) == 4
    assert ref.e2m1_encode(2.5) == 4 and ref.e2m1_encode(3.5) == 6 and ref.e2m1_encode(5.0) == 6
    assert ref.e2m1_encode(-3.5) == 0xE
    assert ref.e2m1_encode(7.0) == 7 and ref.e2m1_encode(INF) == 7 and ref.e2m1_encode(-1e30) == 0xF  # saturation
    assert ref.e2m1_encode(-0.0) == 0x8 and ref.e2m1_encode(-0.1) == 0x8  # negative zero
    assert ref.e4m3_encode(1.0625) == 0x38 and ref.e4m3_encode(1.1875) == 0x3A  # ties to even mantissa
    assert ref.e4m3_encode(2.0 ** -10) == 0x00 and ref.e4m3_encode(3 * 2.0 ** -10) == 0x02  # subnormal ties
    assert ref.e4m3_encode(464.0) == 0x7E and ref.e4m3_encode(1e6) == 0x7E and ref.e4m3_encode(-1e6) == 0xFE


# --- the reference against hand-computed blocks --------------------------------------------

def _block(head, n, fill=0.0):
    return list(head) + [fill] * (n - len(head))


def test_mxfp8_known_blocks():
    codes, sc = ref.quantize_block(_block([], 32), "mxfp8")
    assert sc == 0x00 and codes == [0] * 32  # all zero: the smallest scale, 2**-127
    # amax 1: X = 2**(0 - 8); 1 -> 256 = 1.0 * 2**8 (0x78), 0.5 -> 0x70, -1 -> 0xF8
    codes, sc = ref.quantize_block(_block([1.0, 0.5, -1.0, 2.0 ** -17, 2.0 ** -18, 3 * 2.0 ** -18, -0.0], 32), "mxfp8")
    assert sc == 127 - 8
    assert codes[:7] == [0x78, 0x70, 0xF8, 0x01, 0x00, 0x02, 0x80]
    # amax 480: floor(log2(480)) = 8, X = 1, 480 saturates to 448 (0x7E)
    codes, sc = ref.quantize_block(_block([480.0, 448.0, -480.0], 32), "mxfp8")
    assert sc == 127 and codes[:3] == [0x7E, 0x7E, 0xFE]
    # tiny amax: the exponent clamps at -127 and elements are scaled up by 2**127
    codes, sc = ref.quantize_block(_block([2.0 ** -130], 32), "mxfp8")
    assert sc == 0 and codes[0] == ref.e4m3_encode(2.0 ** -3)
    # NaN or Inf anywhere: the NaN scale, elements 0
    for bad in (NAN, INF, -INF):
        codes, sc = ref.quantize_block(_block([1.0, bad], 32), "mxfp8")
        assert sc == 0xFF and codes == [0] * 32


def test_mxfp4_known_blocks():
    # amax 6: floor(log2(6)) = 2 = emax(E2M1): X = 1
    codes, sc = ref.quantize_block(_block([6.0, 0.25, 0.75, 2.5, 5.0, -3.5, 0.5, 1.0], 32), "mxfp4")
    assert sc == 127 and codes[:8] == [7, 0, 2, 4, 6, 0xE, 1, 2]
    # amax 7: still X = 1 (the spec's floor), 7 saturates to 6
    codes, sc = ref.quantize_block(_block([7.0, -7.0, 3.0], 32), "mxfp4")
    assert sc == 127 and codes[:3] == [7, 0xF, 5]
    # amax 1: X = 2**-2; 0.125 -> 0.5 (code 1)
    codes, sc = ref.quantize_block(_block([1.0, 0.125], 32), "mxfp4")
    assert sc == 125 and codes[:2] == [6, 1]
    codes, sc = ref.quantize_block(_block([NAN], 32), "mxfp4")
    assert sc == 0xFF and codes == [0] * 32


def test_nvfp4_known_blocks():
    # s = 1, amax 6: sf = 6 * fp32(1/6) rounds to 1.0 (0x38), elements unscaled
    codes, sc = ref.quantize_block(_block([6.0, -1.5, 0.25], 16), "nvfp4", 1.0)
    assert sc == 0x38 and codes[:3] == [7, 0xB, 0]
    # s = 224 (448 * 6 / 12), amax 12: sf = 448 (0x7E), element scale 1 / (448 / 224) = 0.5
    codes, sc = ref.quantize_block(_block([12.0, 3.0, -1.0], 16), "nvfp4", 224.0)
    assert sc == 0x7E and codes[:3] == [7, 3, 0x9]
    codes, sc = ref.quantize_block(_block([], 16), "nvfp4", 3.0)
    assert sc == 0 and codes == [0] * 16
    codes, sc = ref.quantize_block(_block([1.0, NAN], 16), "nvfp4", 1.0)
    assert sc == 0x7F and codes == [0] * 16


def test_packing_and_layout_offsets():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 0.5 * 4, 1.0 * 4  # amax 4: X = 1, codes 4 (2.0) and 6 (4.0)
    data, scales = ref.quantize(x, "mxfp4")
    assert data[0, 0].item() == 0x64  # element 0 in the low nibble
    assert scales.shape == (1, 1)
    # 128x4: [r % 32][r // 32 % 4][c % 4] inside tiles of 128 x 4, column tiles fastest
    assert ref.scale_offset(0, 0, 200, 6, "128x4") == 0
    assert ref.scale_offset(1, 0, 200, 6, "128x4") == 16
    assert ref.scale_offset(32, 0, 200, 6, "128x4") == 4
    assert ref.scale_offset(0, 3, 200, 6, "128x4") == 3
    assert ref.scale_offset(0, 4, 200, 6, "128x4") == 512
    assert ref.scale_offset(128, 0, 200, 6, "128x4") == 1024
    assert ref.scale_extent(200, 6, "128x4") == (256, 8)
    assert ref.scale_offset(1, 0, 20, 6, "8x4") == 4
    assert ref.scale_offset(0, 4, 20, 6, "8x4") == 32
    assert ref.scale_offset(8, 0, 20, 6, "8x4") == 64
    assert ref.scale_extent(20, 6, "8x4") == (24, 8)


def test_reference_round_trip_error_bound():
    """Dequantized values are within half an element step of the input, or clipped to the
    largest element (the spec's scale leaves amax / X in [2**emax, 2**(emax + 1)))."""
    x = random_input(8, 64, torch.float32, seed=3)[:1]  # row 0: plain random values
    for name, emax, man_bits, max_norm in (("mxfp8", 8, 3, 448.0), ("mxfp4", 2, 1, 6.0)):
        data, scales = ref.quantize(x, name)
        back = ref.dequantize(data, scales, name, "linear", 1, 64)
        for b in range(2):
            blk = x[0, b * 32:(b + 1) * 32].double()
            amax = float(blk.abs().max())
            X = 2.0 ** (math.floor(math.log2(amax)) - emax)
            half_step = X * 2.0 ** (emax - man_bits - 1)
            clip = max(0.0, amax - max_norm * X)
            err = (back[0, b * 32:(b + 1) * 32] - blk).abs()
            assert float(err.max()) <= max(half_step, clip), (name, b)
            assert float(err.max()) > 0  # the bound is not vacuous: something was rounded


# --- production against the reference ------------------------------------------------------

def _check_against_reference(x, name, od, sd, layout):
    s = nvfp4_scale(x) if name == "nvfp4" else None
    data, scales = quant.quantize(x, od, layout, scalar_scale=s, scales_dtype=sd)
    (dshape, ddtype), (sshape, sdtype) = quant.output_shapes(x.shape[0], x.shape[1], od, layout, scales_dtype=sd)
    assert data.shape == dshape and data.dtype == ddtype
    assert scales.shape == sshape and scales.dtype == sdtype
    rdata, rscales = ref.quantize(x, name, REF_LAYOUT[layout], s if s is not None else 1.0)
    assert torch.equal(data.view(torch.uint8), rdata), f"{name} {layout.name} {x.dtype}: data differs"
    assert torch.equal(scales.view(torch.uint8), rscales), f"{name} {layout.name} {x.dtype}: scales differ"


@pytest.mark.parametrize("fmt", FORMATS, ids=[f[0] for f in FORMATS])
@pytest.mark.parametrize("layout", LAYOUTS, ids=[lay.name for lay in LAYOUTS])
def test_host_matches_reference_every_layout(fmt, layout):
    name, od, sd = fmt
    H = 96 if name != "nvfp4" else 48  # 3 scale columns: the swizzled layouts pad columns
    _check_against_reference(random_input(130, H, torch.bfloat16, seed=11), name, od, sd, layout)


@pytest.mark.parametrize("fmt", FORMATS, ids=[f[0] for f in FORMATS])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_host_matches_reference_every_dtype(fmt, dtype):
    name, od, sd = fmt
    x = random_input(20, 64, dtype, seed=5)
    if dtype == torch.float32:
        x[7, :8] = torch.tensor([1e-40, -3e-42, 2.0 ** -149, 0.0, 1e-39, 5e-41, -1e-45, 1e-38])  # fp32 subnormals
        x[8, :32] = 1e-40
    _check_against_reference(x, name, od, sd, quant.SfLayout.layout_8x4)


def test_host_nvfp4_other_global_scales():
    x = random_input(9, 32, torch.bfloat16, seed=2)
    for s in (1.0, 0.37, 1e4, 3.0e-5):
        data, scales = quant.quantize(x, "nvfp4", quant.SfLayout.layout_linear, scalar_scale=torch.tensor([s]))
        rdata, rscales = ref.quantize(x, "nvfp4", "linear", s)
        assert torch.equal(data, rdata) and torch.equal(scales.view(torch.uint8), rscales), s


def test_into_caller_buffers_and_padding_zeroed():
    x = random_input(5, 64, torch.bfloat16, seed=9)
    (dshape, ddtype), (sshape, sdtype) = quant.output_shapes(5, 64, torch.float8_e4m3fn, quant.SfLayout.layout_128x4)
    assert sshape == (128, 4)
    out = torch.empty(dshape, dtype=ddtype)
    out_scales = torch.full((sshape[0] * sshape[1],), 0xAA, dtype=torch.uint8)  # any shape of the right extent
    d, s = quant.quantize(x, torch.float8_e4m3fn, quant.SfLayout.layout_128x4, out=out, out_scales=out_scales)
    assert d is out and s is out_scales
    rdata, rscales = ref.quantize(x, "mxfp8", "128x4")
    assert torch.equal(out.view(torch.uint8), rdata)
    assert torch.equal(out_scales, rscales.reshape(-1))  # padding is 0, not the old 0xAA
    # packed FP4: the out_scales dtype tells MXFP4 from NVFP4, as in FlashInfer
    o4 = torch.empty(5, 32, dtype=torch.uint8)
    s4 = torch.empty(5, 4, dtype=torch.float8_e4m3fn)
    quant.quantize(x, torch.uint8, quant.SfLayout.layout_linear, scalar_scale=2.0, out=o4, out_scales=s4)
    rdata, rscales = ref.quantize(x, "nvfp4", "linear", 2.0)
    assert torch.equal(o4, rdata) and torch.equal(s4.view(torch.uint8), rscales)


def test_empty_and_flashinfer_layout_values():
    assert (quant.SfLayout.layout_128x4, quant.SfLayout.layout_8x4, quant.SfLayout.layout_linear) == (0, 1, 2)
    d, s = quant.quantize(torch.zeros(0, 64, dtype=torch.bfloat16), torch.float8_e4m3fn, quant.SfLayout.layout_128x4)
    assert d.shape == (0, 64) and s.shape == (0, 4)
    d, s = quant.quantize(torch.zeros(3, 64), torch.float8_e4m3fn, None)  # None: linear, as FlashInfer
    assert s.shape == (3, 2)


# --- argument checks -----------------------------------------------------------------------

def test_argument_errors():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(errors.InputError, match="hidden size 48 is not a multiple of the MXFP8 block of 32"):
        quant.quantize(torch.zeros(4, 48), torch.float8_e4m3fn, quant.SfLayout.layout_linear)
    with pytest.raises(errors.InputError, match="hidden size 40 is not a multiple of the NVFP4 block of 16"):
        quant.output_shapes(4, 40, "nvfp4", 2)
    with pytest.raises(errors.InputError, match=r"out: shape \[4, 32\], expected \[4, 64\]"):
        quant.quantize(x, torch.float8_e4m3fn, 2, out=torch.empty(4, 32, dtype=torch.float8_e4m3fn))
    with pytest.raises(errors.InputError, match="out: dtype torch.uint8, expected torch.float8_e4m3fn"):
        quant.quantize(x, torch.float8_e4m3fn, 2, out=torch.empty(4, 64, dtype=torch.uint8))
    with pytest.raises(errors.InputError, match="out_scales: 8 elements .* the layout needs 512"):
        quant.quantize(x, torch.float8_e4m3fn, 0, out_scales=torch.empty(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="out_scales: MXFP8 .* scales are torch.uint8"):
        quant.quantize(x, torch.float8_e4m3fn, 2, out_scales=torch.empty(4, 2, dtype=torch.float8_e4m3fn))
    with pytest.raises(errors.InputError, match="out_scales: must be contiguous"):
        quant.quantize(x, torch.float8_e4m3fn, 2, out_scales=torch.empty(2, 4, dtype=torch.uint8).t())
    with pytest.raises(errors.InputError, match="scalar_scale: NVFP4 needs the per-tensor global scale"):
        quant.quantize(x, "nvfp4", 2)
    for bad in (0.0, -1.0, float("inf"), float("nan"), 1e39):
        with pytest.raises(errors.InputError, match="scalar_scale: must be positive and finite"):
            quant.quantize(x, "nvfp4", 2, scalar_scale=bad)
    with pytest.raises(errors.InputError, match="scalar_scale: must hold one element"):
        quant.quantize(x, "nvfp4", 2, scalar_scale=torch.ones(2))
    with pytest.raises(ValueError, match="sf_layout: unknown layout 7"):
        quant.quantize(x, torch.float8_e4m3fn, 7)
    with pytest.raises(ValueError, match="sf_layout: unknown layout 'swizzled'"):
        quant.output_shapes(4, 64, torch.float8_e4m3fn, "swizzled")
    with pytest.raises(ValueError, match="output_dtype torch.uint8 .* pass out_scales, or scales_dtype"):
        quant.quantize(x, torch.uint8, 2)
    with pytest.raises(ValueError, match="output_dtype: torch.bfloat16 is not a quantized output"):
        quant.quantize(x, torch.bfloat16, 2)
    with pytest.raises(errors.InputError, match="x: dtype torch.int32"):
        quant.quantize(torch.zeros(4, 64, dtype=torch.int32), torch.float8_e4m3fn, 2)
    with pytest.raises(errors.InputError, match=r"x: must be \[T, H\]"):
        quant.quantize(torch.zeros(64), torch.float8_e4m3fn, 2)


# --- the kernel's arithmetic, run on the host ----------------------------------------------

NATIVE = Path(__file__).resolve().parent / "native"
CSRC = Path(__file__).resolve().parent.parent / "csrc"
_DTYPE_CODE = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_FMT_CODE = {"mxfp8": 0, "mxfp4": 1, "nvfp4": 2}


@pytest.fixture(scope="module")
def host_driver(tmp_path_factory):
    """csrc/quantize.cu's per-block code built with a host driver (needs nvcc, no GPU)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not on PATH")
    out = tmp_path_factory.mktemp("quant_driver") / "quantize_host_driver"
    cmd = [nvcc, "-arch=sm_90", "-std=c++17", "-O2", "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
           "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__", f"-I{CSRC}", "-o", str(out),
           str(NATIVE / "quantize_host_driver.cu")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def _run_driver(driver, tmp_path, x, name, layout, scale):
    src = tmp_path / "in.bin"
    src.write_bytes(x.contiguous().view(torch.uint8).numpy().tobytes())
    out, sc = tmp_path / "out.bin", tmp_path / "scales.bin"
    T, H = x.shape
    args = [str(driver), str(src), str(_DTYPE_CODE[x.dtype]), str(T), str(H), str(_FMT_CODE[name]), str(int(layout)),
            repr(float(scale)), str(out), str(sc)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    data = torch.frombuffer(bytearray(out.read_bytes()), dtype=torch.uint8)
    scales = torch.frombuffer(bytearray(sc.read_bytes()), dtype=torch.uint8)
    return data, scales


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", FORMATS, ids=[f[0] for f in FORMATS])
def test_kernel_arithmetic_on_host_matches_reference(fmt, host_driver, tmp_path):
    """The kernel's own code (every layout, every input dtype, padding included) against the
    reference; the GPU run of the same code is tests/test_quant_cuda.py."""
    name = fmt[0]
    cases = [(random_input(130, 96 if name != "nvfp4" else 48, torch.bfloat16, seed=11), layout) for layout in LAYOUTS]
    for dtype in (torch.float16, torch.float32):
        x = random_input(20, 64, dtype, seed=5)
        if dtype == torch.float32:
            x[7, :8] = torch.tensor([1e-40, -3e-42, 2.0 ** -149, 0.0, 1e-39, 5e-41, -1e-45, 1e-38])
            x[8, :32] = 1e-40
        cases.append((x, quant.SfLayout.layout_8x4))
    for x, layout in cases:
        s = nvfp4_scale(x) if name == "nvfp4" else 1.0
        s = float(torch.tensor(s, dtype=torch.float32))  # what the kernel receives
        data, scales = _run_driver(host_driver, tmp_path, x, name, layout, s)
        rdata, rscales = ref.quantize(x, name, REF_LAYOUT[layout], s)
        assert torch.equal(data, rdata.reshape(-1)), f"{name} {layout.name} {x.dtype}: data differs"
        assert torch.equal(scales, rscales.reshape(-1)), f"{name} {layout.name} {x.dtype}: scales differ"


def test_traces_under_torch_compile_fullgraph():
    """quantize traces without a graph break (the front end's combine calls it under
    torch.compile(fullgraph=True)); the compiled result equals the eager one."""
    x = random_input(10, 64, torch.bfloat16, seed=13)

    def f(x):
        return quant.quantize(x, torch.uint8, quant.SfLayout.layout_128x4, scalar_scale=3.0,
                              scales_dtype=torch.float8_e4m3fn)

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    want = f(x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8))
