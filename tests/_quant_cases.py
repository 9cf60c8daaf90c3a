"""Inputs shared by the quantizer tests (CPU and CUDA)."""

from __future__ import annotations

import torch

from a2ad.client import quant

#: (name as the reference spells it, output_dtype, scales dtype) of every format.
FORMATS = [
    ("mxfp8", torch.float8_e4m3fn, torch.uint8),
    ("mxfp4", torch.uint8, torch.uint8),
    ("nvfp4", torch.uint8, torch.float8_e4m3fn),
]
LAYOUTS = [quant.SfLayout.layout_linear, quant.SfLayout.layout_128x4, quant.SfLayout.layout_8x4]
REF_LAYOUT = {quant.SfLayout.layout_linear: "linear", quant.SfLayout.layout_128x4: "128x4",
              quant.SfLayout.layout_8x4: "8x4"}


def random_input(T: int, H: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[T, H] values over a wide dynamic range (per-16-element magnitudes from 2**-24 to
    2**20, 2**11 for fp16), with exact zeros, negative zeros, tie-rich rows (small multiples of powers of two),
    a NaN and an infinity."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    top = 12 if dtype == torch.float16 else 21  # fp16 overflows above 65504
    mag = torch.randint(-24, top, (T, H // 16), generator=g).to(torch.float64).exp2()
    x = x * mag.repeat_interleave(16, dim=1)
    if T >= 4:
        x[1] = 0.0
        x[2] = -0.0
        ints = torch.randint(-48, 49, (H,), generator=g).to(torch.float64)
        x[3] = ints / 8.0  # many exact ties after scaling
    if T >= 6:
        x[4, 5] = float("nan")
        x[5, H - 1] = float("-inf")
    # a block where one element sits just above the E4M3 / E2M1 saturation point of the scale
    if T >= 7:
        x[6, :32] = 0.75
        x[6, 0] = 480.0 if dtype != torch.float16 else 60.0
    return x.to(dtype)


def nvfp4_scale(x: torch.Tensor) -> float:
    """The customary NVFP4 global scale 448 * 6 / amax over the finite values."""
    finite = x[torch.isfinite(x)].float().abs()
    amax = float(finite.max()) if finite.numel() else 1.0
    return 448.0 * 6.0 / amax if amax > 0 else 1.0
