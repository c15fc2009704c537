"""worker/video/yuv.py: YUV 4:2:0 -> RGB bit for bit as PyAV (swscale) gives it, for the
colour matrices and ranges a stream may declare, from planes and from NV12 (NVDEC's layout)."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
import torch

from triptych.worker.video.yuv import nv12_to_rgb, yuv420_to_rgb


def _clip(width: int, height: int, x264: str) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"x264-params": "keyint=24" + x264}
        rng = np.random.default_rng(0)  # noise: every chroma sample differs from its neighbours
        for _ in range(3):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8),
                                               format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def _planes(frame: av.VideoFrame) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h, w = frame.height, frame.width
    flat = frame.to_ndarray(format="yuv420p").reshape(-1)
    q = (h // 2) * (w // 2)
    y, u, v = flat[:h * w], flat[h * w:h * w + q], flat[h * w + q:h * w + 2 * q]
    return (torch.from_numpy(y.reshape(h, w).copy()), torch.from_numpy(u.reshape(h // 2, w // 2).copy()),
            torch.from_numpy(v.reshape(h // 2, w // 2).copy()))


def _nv12(y: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The planes in NVDEC's layout: luma rows, then rows of interleaved U and V."""
    return torch.cat([y, torch.stack([u, v], -1).reshape(u.shape[0], -1)])


@pytest.mark.parametrize(("size", "x264", "colorspace", "color_range"), [
    ((96, 64), "", 2, 0),  # untagged: BT.601, limited range
    ((70, 46), "", 2, 0),  # a width that is no multiple of 16
    ((96, 64), ":colormatrix=bt709", 1, 1),
    ((96, 64), ":fullrange=on", 2, 2),
    ((96, 64), ":colormatrix=smpte240m", 7, 1),
    ((96, 64), ":colormatrix=bt2020nc", 9, 1),
])
def test_the_conversion_equals_pyavs_bit_for_bit(size: tuple[int, int], x264: str, colorspace: int,
                                                  color_range: int) -> None:
    container = av.open(io.BytesIO(_clip(*size, x264)))
    for frame in container.decode(video=0):
        assert (frame.colorspace, frame.color_range) == (colorspace, color_range)
        want = frame.to_ndarray(format="rgb24")
        y, u, v = _planes(frame)
        got = yuv420_to_rgb(y, u, v, frame.colorspace, frame.color_range).numpy()
        assert got.dtype == np.uint8 and np.array_equal(got, want)
        assert np.array_equal(nv12_to_rgb(_nv12(y, u, v), frame.colorspace, frame.color_range).numpy(), want)
    # Another matrix than the stream's gives other pixels (the test can fail).
    other = 1 if colorspace != 1 else 2
    assert not np.array_equal(yuv420_to_rgb(y, u, v, other, color_range).numpy(), want)


def test_stacked_nv12_frames_convert_as_each_alone() -> None:
    container = av.open(io.BytesIO(_clip(96, 64, ":colormatrix=bt709")))
    frames = list(container.decode(video=0))
    nv12 = torch.stack([_nv12(*_planes(frame)) for frame in frames])
    got = nv12_to_rgb(nv12, 1, 1).numpy()
    assert got.shape == (len(frames), 64, 96, 3)
    for one, frame in zip(got, frames, strict=True):
        assert np.array_equal(one, frame.to_ndarray(format="rgb24"))


def test_an_nv12_frame_without_its_chroma_rows_is_refused() -> None:
    with pytest.raises(ValueError, match="3/2 rows"):
        nv12_to_rgb(torch.zeros(64, 96, dtype=torch.uint8))
