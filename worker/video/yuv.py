"""YUV 4:2:0 -> RGB as FFmpeg's swscale computes it on x86-64, on any torch device.

transformers' video readers (PyAV's `frame.to_ndarray(format="rgb24")`) convert with
swscale, whose x86 SIMD path (libswscale/x86/yuv_2_rgb.asm, coefficients from
`ff_yuv2rgb_c_init_tables`) works in 16-bit fixed point: luma and chroma are shifted left by
3, offset, multiplied by Q13 coefficients keeping the high 16 bits (`pmulhw`, an arithmetic
shift), summed and saturated; each chroma sample serves its 2x2 luma block (no
interpolation). NVDEC's own RGB output uses other arithmetic (a mean of 5.4 levels of 255
off on a 720p clip: docs/benchmarks.md), so the NVDEC backend takes NV12 and converts here:
H.264 decoding is bit-exact, so the pixels equal PyAV's. The coefficients follow the
stream's colour matrix and range as PyAV does (unspecified: BT.601).
"""

from __future__ import annotations

import torch

# swscale's ff_yuv2rgb_coeffs (crv, cbu, cgu, cgv; 16.16), by AVColorSpace value.
_BT601 = (104597, 132201, 25675, 53279)
_BT709 = (117489, 138438, 13975, 34925)
_COEFFS = {0: _BT709, 1: _BT709, 4: (104448, 132798, 24759, 53109), 7: (117579, 136230, 16907, 35559),
           9: (110013, 140363, 12277, 42626), 10: (110013, 140363, 12277, 42626)}
FULL_RANGE = 2  # AVCOL_RANGE_JPEG


def _q13(x: int) -> int:
    """swscale's roundToInt16(x << 13): a 16.16 coefficient as Q13, rounded."""
    return (x * 8192 + 32768) >> 16


def coefficients(colorspace: int = 2, color_range: int = 0) -> tuple[int, int, int, int, int, int]:
    """(y, vr, ub, vg, ug, y_offset) as swscale's SIMD path uses them."""
    crv, cbu, cgu, cgv = _COEFFS.get(colorspace, _BT601)
    if color_range == FULL_RANGE:
        cy, oy = 1 << 16, 0
        crv, cbu, cgu, cgv = (c * 224 // 255 for c in (crv, cbu, cgu, cgv))
    else:
        cy, oy = (1 << 16) * 255 // 219, 16 << 16
    return _q13(cy), _q13(crv), _q13(cbu), _q13(-cgv), _q13(-cgu), (oy * 8 + 32768) >> 16


def yuv420_to_rgb(y: torch.Tensor, u: torch.Tensor, v: torch.Tensor, colorspace: int = 2,
                  color_range: int = 0) -> torch.Tensor:
    """Planes [..., H, W], [..., H/2, W/2] (uint8) -> RGB [..., H, W, 3] uint8."""
    cy, vr, ub, vg, ug, y_off = coefficients(colorspace, color_range)
    height, width = y.shape[-2:]

    def widen(c: torch.Tensor) -> torch.Tensor:  # each chroma sample for its 2x2 block
        c = (c.to(torch.int32) - 128) * 8
        return c.repeat_interleave(2, -2).repeat_interleave(2, -1)[..., :height, :width]

    luma = ((y.to(torch.int32) * 8 - y_off) * cy) >> 16
    u8, v8 = widen(u), widen(v)
    r = luma + ((v8 * vr) >> 16)
    g = luma + ((u8 * ug) >> 16) + ((v8 * vg) >> 16)
    b = luma + ((u8 * ub) >> 16)
    return torch.stack([r, g, b], -1).clamp_(0, 255).to(torch.uint8)


def nv12_to_rgb(nv12: torch.Tensor, colorspace: int = 2, color_range: int = 0) -> torch.Tensor:
    """NV12 frames [..., H * 3/2, W] (the luma plane, then interleaved U/V rows) -> [..., H, W, 3]:
    a segment's frames stacked convert in one pass (a few kernels, not a few per frame)."""
    rows, width = nv12.shape[-2:]
    if rows % 3:
        raise ValueError(f"an NV12 frame has H * 3/2 rows, not {rows}")
    height = rows * 2 // 3
    uv = nv12[..., height:, :].reshape(*nv12.shape[:-2], height // 2, width // 2, 2)
    return yuv420_to_rgb(nv12[..., :height, :], uv[..., 0], uv[..., 1], colorspace, color_range)
