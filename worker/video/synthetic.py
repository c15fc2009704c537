"""Synthetic test clips encoded with PyAV (tests and `triptych bench video`).

Frames are a moving colour gradient plus seeded noise: every frame differs from its
neighbours (so a frame taken from the wrong position is caught) and encoders still
produce real P/B-frame prediction.
"""

from __future__ import annotations

import io

import numpy as np

# codec -> container format it is muxed into
CONTAINERS = {"libx264": "mp4", "mpeg4": "mp4", "libvpx-vp9": "webm"}


def frame_pixels(i: int, width: int, height: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed * 100_003 + i)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * 3 + i * 5) % 256, (y * 2 + i * 3) % 256, (x + y + i * 7) % 256], axis=-1)
    noise = rng.integers(-24, 25, size=(height, width, 3))
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def make_clip(num_frames: int, width: int = 64, height: int = 48, fps: int = 24, codec: str = "libx264",
              gop: int = 8, b_frames: int = 2, open_gop: bool = False, preset: str = "veryfast",
              seed: int = 0) -> bytes:
    """Encode `num_frames` synthetic frames; `gop` is the fixed keyframe interval (0: one GOP)."""
    import av

    keyint = gop if gop > 0 else num_frames + 1
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=CONTAINERS[codec]) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.gop_size = keyint
        stream.codec_context.max_b_frames = b_frames
        if codec == "libx264":
            stream.options = {"preset": preset, "x264-params": (
                f"keyint={keyint}:min-keyint={keyint}:scenecut=0:bframes={b_frames}:"
                f"open-gop={int(open_gop)}")}
        elif codec == "libvpx-vp9":
            stream.options = {"deadline": "realtime", "cpu-used": "8", "g": str(keyint),
                              "keyint_min": str(keyint)}
        for i in range(num_frames):
            frame = av.VideoFrame.from_ndarray(frame_pixels(i, width, height, seed), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def sequential_decode(data: bytes) -> np.ndarray:
    """Every frame, decoded plainly front to back by PyAV (the reference for pixel identity)."""
    import av

    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def audio_only_clip() -> bytes:
    """A Matroska container whose video stream carries no packet (audio only): zero frames."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as container:
        video = container.add_stream("mpeg4", rate=24)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        audio = container.add_stream("aac", rate=16000)
        audio.layout = "mono"
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate, frame.pts = 16000, 0
        for packet in [*audio.encode(frame), *audio.encode()]:
            container.mux(packet)
    return buf.getvalue()
