"""Reference block quantizer: MXFP8, MXFP4 and NVFP4, written from their definitions.

Plain and slow on purpose (Python loops over blocks, element codes chosen by searching
the full table of representable values); :mod:`a2ad.client.quant` is checked bit for bit
against it. Nothing here is shared with the production code.

Formats (input ``x``: ``[T, H]`` float tensor, blocks of consecutive elements of a row):

- **MXFP8** (OCP Microscaling v1.0): E4M3 elements, one UE8M0 scale per 32 elements.
- **MXFP4** (OCP Microscaling v1.0): E2M1 elements packed two per byte (element ``2j`` in
  the low nibble of byte ``j``), one UE8M0 scale per 32 elements.
- **NVFP4** (NVIDIA): E2M1 elements packed as above, one UE4M3 (FP8 E4M3 with the sign
  always 0) scale per 16 elements, and a per-tensor fp32 global scale ``s`` (FlashInfer's
  ``output_scalar_scale``, its kernels' ``SFScaleVal``: the encode-direction scale, e.g.
  ``448 * 6 / amax(x)``; a consumer dequantizes with ``e2m1 * ue4m3 / s``).

Scale choice
------------
MX (spec section 6.3): ``X = 2**(floor(log2(amax)) - emax_elem)`` with ``emax_elem`` the
exponent of the element type's largest normal (8 for E4M3: 448 = 1.75 * 2**8; 2 for E2M1:
6 = 1.5 * 2**2). The exponent is clamped to the UE8M0 range ``[-127, 127]``: an all-zero
block gets ``2**-127`` (byte 0x00). Note that FlashInfer's MX kernels choose
``2**ceil(log2(amax / elem_max))`` instead (a larger scale for some blocks, so that no
element clips); this quantizer follows the spec, so MX scales (and the elements of such
blocks) can differ from FlashInfer's by one binade, while both decode with the same
``element * 2**(byte - 127)``.

NVFP4: the block scale is ``ue4m3(amax * (s * fp32(1/6)))`` and elements are
``e2m1(v * min(1 / (fp32(ue4m3) * (1 / s)), FLT_MAX))`` (0 for an all-zero block), every
operation one IEEE fp32 operation rounded to nearest even, in that order: this is the
operation sequence of FlashInfer's exact (non fast-math) NVFP4 recipe, the one that matches
Transformer Engine, so the bits agree with it wherever FlashInfer does not use its
approximate reciprocals.

Element rounding and saturation
-------------------------------
Every element conversion rounds to nearest, ties to the even code (the one whose lowest
mantissa bit is 0), and saturates: a magnitude above the largest finite value becomes that
value (448 for E4M3, 6 for E2M1), as the spec's "clamp to max normal" and FlashInfer's
``satfinite`` conversions do. Subnormals of the element types are used (E4M3 down to 2**-9,
E2M1's 0.5). The sign bit follows the input's, zeros included (-0.0 and negative values that
round to zero encode as negative zero), as the hardware conversions do. MX element values
``v / X`` are exact (``X`` is a power of two) and computed in float64; NVFP4's are the fp32
products above.

Non-finite input
----------------
A block holding a NaN or an infinity has no finite ``amax``: its scale is the scale type's
NaN (UE8M0 0xFF, UE4M3 0x7F), which by the spec makes every value of the block NaN, and its
element bytes are all 0. (FlashInfer propagates neither: it ignores NaN in the maximum and
clips infinities; a2ad keeps the block's NaN visible to the consumer.)

Scale-factor layouts (FlashInfer's ``SfLayout``), ``R = T`` rows, ``C = H / block`` columns:

- ``layout_linear``: ``[R, C]`` row-major, no padding.
- ``layout_128x4``: rows padded to a multiple of 128, columns to a multiple of 4; tiles of
  128 rows x 4 columns stored in row-major tile order (column tiles fastest); inside a tile
  entry ``(r, c)`` sits at ``(r % 32) * 16 + (r // 32) * 4 + c``.
- ``layout_8x4``: rows padded to 8, columns to 4; tiles of 8 x 4, tile order as above;
  inside a tile entry ``(r, c)`` sits at ``r * 4 + c``.

Padding entries are 0.
"""

from __future__ import annotations

import math

import torch

MXFP8 = "mxfp8"
MXFP4 = "mxfp4"
NVFP4 = "nvfp4"
FORMATS = (MXFP8, MXFP4, NVFP4)
BLOCK = {MXFP8: 32, MXFP4: 32, NVFP4: 16}

LINEAR = "linear"
SWIZZLE_128x4 = "128x4"
SWIZZLE_8x4 = "8x4"
LAYOUTS = (LINEAR, SWIZZLE_128x4, SWIZZLE_8x4)


# --- element types, from their bit definitions --------------------------------------------

def e4m3_value(code: int) -> float:
    """Value of an FP8 E4M3 (fn) code: bias 7, no infinities, S.1111.111 is NaN."""
    sign = -1.0 if code & 0x80 else 1.0
    exp = (code >> 3) & 0xF
    man = code & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * man * 2.0 ** -9  # subnormal: 0.man * 2**(1 - 7)
    return sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7)


def e2m1_value(code: int) -> float:
    """Value of an FP4 E2M1 code: bias 1, no infinities or NaN."""
    sign = -1.0 if code & 0x8 else 1.0
    exp = (code >> 1) & 0x3
    man = code & 0x1
    if exp == 0:
        return sign * man * 0.5
    return sign * (1.0 + man / 2.0) * 2.0 ** (exp - 1)


def _magnitude_table(value_of, codes):
    """(magnitude, code) of every finite non-negative code, ascending."""
    out = []
    for c in codes:
        v = value_of(c)
        if not math.isnan(v):
            out.append((v, c))
    return sorted(out)


_E4M3_POS = _magnitude_table(e4m3_value, range(0x80))
_E2M1_POS = _magnitude_table(e2m1_value, range(0x8))


def _round_to_code(v: float, table, sign_bit: int) -> int:
    """Nearest table entry to |v| (ties to the even code), saturating; sign from v."""
    neg = math.copysign(1.0, v) < 0
    a = abs(v)
    best_val, best_code = table[-1]
    if a < best_val:
        for (lo, lo_code), (hi, hi_code) in zip(table, table[1:]):
            if lo <= a <= hi:
                if a - lo < hi - a:
                    best_code = lo_code
                elif hi - a < a - lo:
                    best_code = hi_code
                else:
                    best_code = lo_code if lo_code % 2 == 0 else hi_code
                break
    return best_code | (sign_bit if neg else 0)


def e4m3_encode(v: float) -> int:
    """E4M3 code of the finite value *v*: round to nearest even, saturate at 448."""
    return _round_to_code(v, _E4M3_POS, 0x80)


def e2m1_encode(v: float) -> int:
    """E2M1 code of the finite value *v*: round to nearest even, saturate at 6."""
    return _round_to_code(v, _E2M1_POS, 0x8)


def f32(v: float) -> float:
    """*v* rounded to the nearest fp32 (ties to even)."""
    return float(torch.tensor(v, dtype=torch.float64).to(torch.float32).item())


def _mul32(a: float, b: float) -> float:
    return float((torch.tensor(a, dtype=torch.float32) * torch.tensor(b, dtype=torch.float32)).item())


def _div32(a: float, b: float) -> float:
    return float((torch.tensor(a, dtype=torch.float32) / torch.tensor(b, dtype=torch.float32)).item())


FLT_MAX = float(torch.finfo(torch.float32).max)


# --- one block -----------------------------------------------------------------------------

def quantize_block(values: list[float], fmt: str, global_scale: float = 1.0) -> tuple[list[int], int]:
    """Element codes and scale byte of one block of *values* (Python floats, each exactly an
    fp32 value) in format *fmt*."""
    if any(math.isnan(v) or math.isinf(v) for v in values):
        return [0] * len(values), (0x7F if fmt == NVFP4 else 0xFF)
    amax = max(abs(v) for v in values)
    if fmt in (MXFP8, MXFP4):
        emax_elem = 8 if fmt == MXFP8 else 2
        if amax == 0.0:
            exp = -127
        else:
            m, e = math.frexp(amax)  # amax = m * 2**e, 0.5 <= m < 1
            exp = (e - 1) - emax_elem
            exp = max(-127, min(127, exp))
        scale = 2.0 ** exp
        encode = e4m3_encode if fmt == MXFP8 else e2m1_encode
        codes = [encode(v / scale) for v in values]
        return codes, exp + 127
    # NVFP4
    s = f32(global_scale)
    sf = _mul32(amax, _mul32(s, f32(1.0 / 6.0)))
    sf_code = e4m3_encode(sf) if not math.isinf(sf) else 0x7E
    if math.isnan(sf):
        return [0] * len(values), 0x7F
    if amax == 0.0:
        return [e2m1_encode(v * 0.0) for v in values], sf_code
    sf_val = e4m3_value(sf_code)
    out_scale = min(_div32(1.0, _mul32(sf_val, _div32(1.0, s))), FLT_MAX)
    codes = [e2m1_encode(_mul32(v, out_scale)) for v in values]
    return codes, sf_code


# --- scale-factor layouts ------------------------------------------------------------------

def _ceil_to(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def scale_extent(rows: int, cols: int, layout: str) -> tuple[int, int]:
    """(padded rows, padded columns) of the scale-factor array of *rows* x *cols* scales."""
    if layout == LINEAR:
        return rows, cols
    if layout == SWIZZLE_128x4:
        return _ceil_to(rows, 128), _ceil_to(cols, 4)
    if layout == SWIZZLE_8x4:
        return _ceil_to(rows, 8), _ceil_to(cols, 4)
    raise ValueError(f"unknown layout {layout!r}")


def scale_offset(r: int, c: int, rows: int, cols: int, layout: str) -> int:
    """Flat position of scale ``(r, c)`` of a *rows* x *cols* scale array in *layout*."""
    _, pcols = scale_extent(rows, cols, layout)
    if layout == LINEAR:
        return r * cols + c
    col_tiles = pcols // 4
    if layout == SWIZZLE_128x4:
        tile = (r // 128) * col_tiles + (c // 4)
        rr = r % 128
        return tile * 512 + (rr % 32) * 16 + (rr // 32) * 4 + (c % 4)
    tile = (r // 8) * col_tiles + (c // 4)
    return tile * 32 + (r % 8) * 4 + (c % 4)


# --- whole tensor --------------------------------------------------------------------------

def quantize(x: torch.Tensor, fmt: str, layout: str = LINEAR, global_scale: float = 1.0):
    """Quantize ``x`` ``[T, H]`` (CPU; bf16, fp16 or fp32) to *fmt* with scales in *layout*.

    Returns ``(data, scales)``: ``data`` is ``uint8`` ``[T, H]`` (MXFP8, E4M3 codes) or
    ``[T, H // 2]`` (FP4, packed); ``scales`` is ``uint8`` ``[rows, cols]`` (padded extent
    of *layout*) holding the scale bytes (UE8M0, or UE4M3 for NVFP4)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}")
    block = BLOCK[fmt]
    T, H = x.shape
    if H % block:
        raise ValueError(f"H {H} is not a multiple of the block {block}")
    vals = x.detach().to("cpu", torch.float32).tolist()
    cols = H // block
    prow, pcol = scale_extent(T, cols, layout)
    scales = [0] * (prow * pcol)
    fp4 = fmt != MXFP8
    data = [[0] * (H // 2 if fp4 else H) for _ in range(T)]
    for t in range(T):
        for b in range(cols):
            codes, sc = quantize_block(vals[t][b * block:(b + 1) * block], fmt, global_scale)
            scales[scale_offset(t, b, T, cols, layout)] = sc
            for i, code in enumerate(codes):
                j = b * block + i
                if fp4:
                    data[t][j // 2] |= code << (4 * (j % 2))
                else:
                    data[t][j] = code
    data_t = torch.tensor(data, dtype=torch.uint8).reshape(T, H // 2 if fp4 else H)
    scales_t = torch.tensor(scales, dtype=torch.uint8).reshape(prow, pcol)
    return data_t, scales_t


def dequantize(data: torch.Tensor, scales: torch.Tensor, fmt: str, layout: str, T: int, H: int,
               global_scale: float = 1.0) -> torch.Tensor:
    """float64 ``[T, H]`` values that (*data*, *scales*) encode (for tests)."""
    block = BLOCK[fmt]
    cols = H // block
    d = data.reshape(-1).tolist()
    s = scales.reshape(-1).tolist()
    out = torch.empty(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(H):
            sc_code = s[scale_offset(t, j // block, T, cols, layout)]
            if fmt == NVFP4:
                sc = e4m3_value(sc_code) / f32(global_scale)
            else:
                sc = math.nan if sc_code == 0xFF else 2.0 ** (sc_code - 127)
            if fmt == MXFP8:
                e = e4m3_value(d[t * H + j])
            else:
                byte = d[t * (H // 2) + j // 2]
                e = e2m1_value((byte >> (4 * (j % 2))) & 0xF)
            out[t, j] = e * sc
    return out
