"""Limits on untrusted video input, checked while demuxing (before any frame is decoded)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class VideoLimits(BaseModel):
    """Each limit exceeded is a typed `VideoError` (a 400 at the router)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_bytes: int = Field(256 * 1024 * 1024, ge=1)
    max_duration_s: float = Field(3600.0, gt=0)
    max_frames: int = Field(216_000, ge=1)  # frames in the container (1 h at 60 fps), not sampled frames
    max_width: int = Field(7680, ge=1)
    max_height: int = Field(4320, ge=1)
    max_pixels: int = Field(3840 * 2160, ge=1)  # per frame
