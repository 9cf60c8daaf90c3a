"""Quantized combine outputs: MXFP8, MXFP4 and NVFP4, scales in FlashInfer's ``SfLayout``s.

``quantize(x, output_dtype, sf_layout, scalar_scale, out=, out_scales=)`` turns a combine
output ``x`` ``[T, H]`` (bf16, fp16 or fp32) into block-quantized data and its scale
factors. The numerics are those of :mod:`a2ad.client.quant_reference` (the OCP MX scale
rule; NVFP4 by FlashInfer's exact recipe; round to nearest even, saturating; a non-finite
block gets the NaN scale), bit for bit, on both backends: CPU tensors take a vectorized
torch path, CUDA tensors the kernel of ``csrc/quantize.cu``.

The format is named as FlashInfer's combine names it:

======================  ====================  ==================  =====  ==================
format                  ``output_dtype``      scales dtype        block  data
======================  ====================  ==================  =====  ==================
MXFP8                   ``torch.float8_e4m3fn``  ``torch.uint8`` (UE8M0)  32  ``[T, H]`` e4m3
MXFP4                   ``torch.uint8``       ``torch.uint8`` (UE8M0)    32  ``[T, H/2]`` packed
NVFP4                   ``torch.uint8``       ``torch.float8_e4m3fn`` (UE4M3)  16  ``[T, H/2]`` packed
======================  ====================  ==================  =====  ==================

Packed FP4 (``torch.uint8``) is MXFP4 or NVFP4 by the dtype of ``out_scales`` (as in
FlashInfer), or of ``scales_dtype=`` when no ``out_scales`` is given. The names
``"mxfp8"``, ``"mxfp4"``, ``"nvfp4"`` are accepted as ``output_dtype`` too.

Scales are returned as ``[rows, cols]``: ``[T, H / block]`` for ``layout_linear``, padded
to multiples of 128 x 4 (``layout_128x4``) or 8 x 4 (``layout_8x4``); padding entries are
0. A caller's ``out_scales`` may have any shape with exactly that many elements (FlashInfer
checks the extent only) and must be contiguous.

NVFP4 needs ``scalar_scale`` (FlashInfer's ``output_scalar_scale``: the per-tensor fp32
encode scale): a positive finite float, or a 1-element tensor (on CUDA it is read by the
kernel, so passing a device tensor adds no host sync). MX formats ignore it.

The CUDA path makes no host sync and is capturable in a CUDA graph; under ``torch.compile``
the kernel is the op ``torch.ops.a2ad_quant.quantize_into`` (eager calls go to the
extension's function directly), so :func:`quantize` traces with ``fullgraph=True``.
"""

from __future__ import annotations

import enum
import math
from typing import Any, Optional

import torch

from a2ad import errors

MXFP8 = "mxfp8"
MXFP4 = "mxfp4"
NVFP4 = "nvfp4"
BLOCK = {MXFP8: 32, MXFP4: 32, NVFP4: 16}
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class SfLayout(enum.IntEnum):
    """Layout of scale factors (FlashInfer's names and values)."""

    layout_128x4 = 0
    layout_8x4 = 1
    layout_linear = 2


_FORMAT_CODE = {MXFP8: 0, MXFP4: 1, NVFP4: 2}
_LAYOUT_NAME = {SfLayout.layout_linear: "linear", SfLayout.layout_128x4: "128x4", SfLayout.layout_8x4: "8x4"}


def _layout(sf_layout: Any) -> SfLayout:
    if sf_layout is None:
        return SfLayout.layout_linear
    if isinstance(sf_layout, str):
        names = {"linear": 2, "layout_linear": 2, "128x4": 0, "layout_128x4": 0, "8x4": 1, "layout_8x4": 1}
        if sf_layout in names:
            return SfLayout(names[sf_layout])
    elif isinstance(sf_layout, int) and not isinstance(sf_layout, bool):  # SfLayout, FlashInfer's, or int
        if int(sf_layout) in (0, 1, 2):
            return SfLayout(int(sf_layout))
    raise ValueError(f"sf_layout: unknown layout {sf_layout!r} (use SfLayout.layout_linear, layout_128x4 or layout_8x4)")


def _format(output_dtype: Any, scales_dtype: Any = None) -> str:
    if isinstance(output_dtype, str) and output_dtype.lower() in BLOCK:
        fmt = output_dtype.lower()
        want = torch.float8_e4m3fn if fmt == NVFP4 else torch.uint8
        if scales_dtype is not None and scales_dtype != want:
            raise ValueError(f"out_scales: {fmt} scales are {want}, got {scales_dtype}")
        return fmt
    if output_dtype == torch.float8_e4m3fn:
        if scales_dtype is not None and scales_dtype != torch.uint8:
            raise ValueError(f"out_scales: MXFP8 (output_dtype torch.float8_e4m3fn) scales are torch.uint8 (UE8M0), "
                             f"got {scales_dtype}")
        return MXFP8
    if output_dtype == torch.uint8:
        if scales_dtype == torch.uint8:
            return MXFP4
        if scales_dtype == torch.float8_e4m3fn:
            return NVFP4
        if scales_dtype is None:
            raise ValueError("output_dtype torch.uint8 (packed FP4) is MXFP4 or NVFP4 by the scales' dtype: pass "
                             "out_scales, or scales_dtype=torch.uint8 (MXFP4) or torch.float8_e4m3fn (NVFP4)")
        raise ValueError(f"out_scales: packed FP4 scales must be torch.uint8 (MXFP4) or torch.float8_e4m3fn (NVFP4), "
                         f"got {scales_dtype}")
    raise ValueError(f"output_dtype: {output_dtype!r} is not a quantized output (torch.float8_e4m3fn for MXFP8, "
                     "torch.uint8 for packed MXFP4/NVFP4)")


def _ceil_to(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _scale_extent(T: int, cols: int, layout: SfLayout) -> tuple[int, int]:
    if layout == SfLayout.layout_128x4:
        return _ceil_to(T, 128), _ceil_to(cols, 4)
    if layout == SfLayout.layout_8x4:
        return _ceil_to(T, 8), _ceil_to(cols, 4)
    return T, cols


def _shapes(T: int, H: int, fmt: str, layout: SfLayout):
    block = BLOCK[fmt]
    if H % block:
        raise errors.InputError(f"x: hidden size {H} is not a multiple of the {fmt.upper()} block of {block}")
    data = ((T, H), torch.float8_e4m3fn) if fmt == MXFP8 else ((T, H // 2), torch.uint8)
    sdt = torch.float8_e4m3fn if fmt == NVFP4 else torch.uint8
    return data, (_scale_extent(T, H // block, layout), sdt)


def output_shapes(T: int, H: int, output_dtype, sf_layout, *, scales_dtype=None):
    """``((data_shape, data_dtype), (scales_shape, scales_dtype))`` of :func:`quantize`'s
    results for a ``[T, H]`` input (*scales_dtype* tells MXFP4 from NVFP4 for packed FP4)."""
    for name, v in (("T", T), ("H", H)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name}: must be a non-negative int, got {v!r}")
    return _shapes(T, H, _format(output_dtype, scales_dtype), _layout(sf_layout))


def _check_out(name: str, t: torch.Tensor, want_shape, want_dtype, x: torch.Tensor, numel_only: bool) -> None:
    if not isinstance(t, torch.Tensor):
        raise errors.InputError(f"{name}: must be a tensor, got {type(t).__name__}")
    if t.device != x.device:
        raise errors.InputError(f"{name}: on {t.device}, x is on {x.device}")
    if t.dtype != want_dtype:
        raise errors.InputError(f"{name}: dtype {t.dtype}, expected {want_dtype}")
    if numel_only:
        n = math.prod(want_shape)
        if t.numel() != n:
            raise errors.InputError(f"{name}: {t.numel()} elements (shape {list(t.shape)}), the layout needs {n} "
                                    f"({want_shape[0]} x {want_shape[1]} including padding)")
    elif tuple(t.shape) != tuple(want_shape):
        raise errors.InputError(f"{name}: shape {list(t.shape)}, expected {list(want_shape)}")
    if not t.is_contiguous():
        raise errors.InputError(f"{name}: must be contiguous (stride {t.stride()})")


def _scalar(scalar_scale, x: torch.Tensor):
    """The NVFP4 global scale: a float, or a 1-element fp32 tensor on x's device (CUDA)."""
    if scalar_scale is None:
        raise errors.InputError("scalar_scale: NVFP4 needs the per-tensor global scale (output_scalar_scale)")
    if isinstance(scalar_scale, torch.Tensor):
        if scalar_scale.numel() != 1:
            raise errors.InputError(f"scalar_scale: must hold one element, got shape {list(scalar_scale.shape)}")
        if not scalar_scale.is_floating_point():
            raise errors.InputError(f"scalar_scale: must be a floating tensor, got {scalar_scale.dtype}")
        if x.is_cuda and scalar_scale.is_cuda:
            if scalar_scale.device != x.device:
                raise errors.InputError(f"scalar_scale: on {scalar_scale.device}, x is on {x.device}")
            return scalar_scale.reshape(1).to(torch.float32).contiguous()
        scalar_scale = float(scalar_scale.reshape(()).item())
    if isinstance(scalar_scale, bool) or not isinstance(scalar_scale, (int, float)):
        raise errors.InputError(f"scalar_scale: must be a float or a 1-element tensor, got {type(scalar_scale).__name__}")
    v = float(torch.tensor(float(scalar_scale), dtype=torch.float32).item())
    if not (math.isfinite(v) and v > 0):
        raise errors.InputError(f"scalar_scale: must be positive and finite (as fp32), got {scalar_scale!r}")
    return v


def quantize(x: torch.Tensor, output_dtype, sf_layout=None, scalar_scale=None, out: torch.Tensor | None = None,
             out_scales: torch.Tensor | None = None, *, scales_dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` ``[T, H]`` to the format *output_dtype* names; return ``(data, scales)``
    (written into *out* / *out_scales* when given). See the module's docstring."""
    if not isinstance(x, torch.Tensor):
        raise errors.InputError(f"x: must be a tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise errors.InputError(f"x: must be [T, H], got shape {list(x.shape)}")
    if x.dtype not in INPUT_DTYPES:
        raise errors.InputError(f"x: dtype {x.dtype} is not one of bfloat16, float16, float32")
    if out_scales is not None and not isinstance(out_scales, torch.Tensor):
        raise errors.InputError(f"out_scales: must be a tensor, got {type(out_scales).__name__}")
    fmt = _format(output_dtype, out_scales.dtype if out_scales is not None else scales_dtype)
    layout = _layout(sf_layout)
    T, H = x.shape
    (dshape, ddtype), (sshape, sdtype) = _shapes(T, H, fmt, layout)
    if out is not None:
        _check_out("out", out, dshape, ddtype, x, numel_only=False)
    else:
        out = torch.empty(dshape, dtype=ddtype, device=x.device)
    if out_scales is not None:
        _check_out("out_scales", out_scales, sshape, sdtype, x, numel_only=True)
    else:
        out_scales = torch.empty(sshape, dtype=sdtype, device=x.device)
    scale = _scalar(scalar_scale, x) if fmt == NVFP4 else 1.0
    if x.is_cuda:
        _quantize_cuda(x, fmt, layout, scale, out, out_scales)
    else:
        _quantize_host(x, fmt, layout, scale, out, out_scales)
    return out, out_scales


# --- CUDA --------------------------------------------------------------------------------

@torch.library.custom_op("a2ad_quant::quantize_into", mutates_args=("out", "scales"), device_types="cuda")
def _quantize_op(x: torch.Tensor, out: torch.Tensor, scales: torch.Tensor, fmt: int, layout: int, scale: float,
                 scale_t: Optional[torch.Tensor]) -> None:
    """The kernel as a torch op, so that :func:`quantize` traces under ``torch.compile``."""
    from . import _ext

    _ext.direct().quantize(x, out, scales, fmt, layout, scale, scale_t)


@_quantize_op.register_fake
def _quantize_op_fake(x, out, scales, fmt, layout, scale, scale_t) -> None:
    return None


def _quantize_cuda(x, fmt, layout, scale, out, out_scales) -> None:
    xs = x if x.is_contiguous() else x.contiguous()
    scale_t = scale if isinstance(scale, torch.Tensor) else None
    scale_f = 1.0 if scale_t is not None else float(scale)
    args = (xs, out.view(torch.uint8), out_scales.view(torch.uint8), _FORMAT_CODE[fmt], int(layout), scale_f, scale_t)
    if torch.compiler.is_compiling():
        _quantize_op(*args)
    else:  # eager: the extension's function directly, without the dispatcher's boxing
        from . import _ext

        _ext.direct().quantize(*args)


# --- host --------------------------------------------------------------------------------

_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_FLT_MAX = torch.finfo(torch.float32).max


def _e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) of fp32 *y* (finite or infinite): round to nearest even, saturate."""
    a = y.abs()
    code = torch.zeros(y.shape, dtype=torch.uint8)
    for k, m in enumerate(_E2M1_MIDPOINTS):
        up = (a > m) if k % 2 == 0 else (a >= m)  # a tie goes to the even code
        code += up.to(torch.uint8)
    return code | (torch.signbit(y).to(torch.uint8) << 3)


def _e4m3_codes(y: torch.Tensor) -> torch.Tensor:
    """E4M3 codes (uint8) of fp32 *y*: round to nearest even, saturate at 448."""
    return y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


def _pow2(n: torch.Tensor) -> torch.Tensor:
    """2**n as fp32, exactly, for int32 *n* in [-127, 127] (built from the bits)."""
    biased = n + 127
    bits = torch.where(biased > 0, biased << 23, torch.full_like(biased, 1 << 22))
    return bits.to(torch.int32).view(torch.float32)


def _scale_index(T: int, cols: int, layout: SfLayout) -> torch.Tensor:
    """Flat position of every scale (row-major over [T, cols]) in *layout*."""
    r = torch.arange(T, dtype=torch.int64).unsqueeze(1)
    c = torch.arange(cols, dtype=torch.int64).unsqueeze(0)
    if layout == SfLayout.layout_linear:
        return (r * cols + c).reshape(-1)
    col_tiles = _ceil_to(cols, 4) // 4
    if layout == SfLayout.layout_128x4:
        rr = r % 128
        idx = ((r // 128) * col_tiles + c // 4) * 512 + (rr % 32) * 16 + (rr // 32) * 4 + c % 4
    else:
        idx = ((r // 8) * col_tiles + c // 4) * 32 + (r % 8) * 4 + c % 4
    return idx.reshape(-1)


def _quantize_host(x, fmt, layout, scale, out, out_scales) -> None:
    T, H = x.shape
    block = BLOCK[fmt]
    cols = H // block
    v = x.to(torch.float32).reshape(T, cols, block)
    amax = v.abs().amax(dim=-1) if v.numel() else torch.zeros(T, cols, dtype=torch.float32)  # NaN propagates
    bad = ~torch.isfinite(amax)  # [T, cols]: the block holds a NaN or an infinity
    amax = amax.masked_fill(bad, 0.0)
    if fmt in (MXFP8, MXFP4):
        emax_elem = 8 if fmt == MXFP8 else 2
        _, e = torch.frexp(amax)  # amax = m * 2**e, 0.5 <= m < 1
        exp = (e.to(torch.int32) - 1 - emax_elem).clamp(-127, 127)
        exp = torch.where(amax == 0, torch.full_like(exp, -127), exp)
        inv = _pow2(-exp)
        y = v * inv.unsqueeze(-1)  # exact: a power of two (result underflow only below the element's range)
        sc = (exp + 127).to(torch.uint8)
        sc = torch.where(bad, torch.full_like(sc, 0xFF), sc)
        codes = _e4m3_codes(y) if fmt == MXFP8 else _e2m1_codes(y)
    else:
        s = torch.tensor(scale, dtype=torch.float32)
        sfv = amax * (s * torch.tensor(1.0 / 6.0, dtype=torch.float32))
        sc = _e4m3_codes(sfv)
        sf_val = sc.view(torch.float8_e4m3fn).to(torch.float32)
        outs = torch.reciprocal(sf_val * torch.reciprocal(s)).clamp(max=_FLT_MAX)
        outs = torch.where(amax == 0, torch.zeros((), dtype=torch.float32), outs)
        y = v * outs.unsqueeze(-1)
        sc = torch.where(bad, torch.full_like(sc, 0x7F), sc)
        codes = _e2m1_codes(y)
    codes = codes.masked_fill_(bad.unsqueeze(-1), 0).reshape(T, H)
    if fmt == MXFP8:
        out.view(torch.uint8).copy_(codes)
    else:
        out.copy_(codes[:, 0::2] | (codes[:, 1::2] << 4))
    flat = out_scales.view(torch.uint8).reshape(-1)
    flat.zero_()
    if T and cols:
        flat[_scale_index(T, cols, layout)] = sc.reshape(-1)
