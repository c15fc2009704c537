"""GOP-aligned segment planning (FlashCodec, paper 000 §3.2, Alg. 1 lines 1-4, Fig. 7b).

The sampled frames of one video are cut into segments at GOP boundaries, so each segment
decodes on its own from a keyframe. A segment is the unit of work the collaborative
scheduler hands to one decoder — FlashCodec's GOP set (§3.3) — and it is a pure
description (pts, byte offsets, frame indices): a decoder thread here or a remote V
instance given the same video bytes can take it.

Temporal-patch alignment (§3.2, Fig. 7b): the model merges `temporal_patch_size` (T)
consecutive frames into one temporal patch. So that patches computed per segment equal
the patches of the whole video, every segment but the last holds a multiple of T frames;
a segment short of that takes the next frames from the following GOP (decoding a little
past its end) instead of giving frames away (which would cost the following segment
nearly a whole extra GOP of decoding). Only the last segment is padded, by patchify.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby

from pydantic import BaseModel, ConfigDict, Field

from .demux import H264, VideoIndex


class GopTask(BaseModel):
    """The frames to take from one GOP: seek to `keyframe_pts`, decode forward."""

    model_config = ConfigDict(frozen=True)

    gop: int
    first_frame: int  # the GOP's first frame (display order)
    keyframe_pts: int
    byte_offset: int
    frame_indices: list[int]
    frame_pts: list[int]


class Segment(BaseModel):
    """One GOP set of one video: the unit of decoding work (local thread or remote V)."""

    model_config = ConfigDict(frozen=True)

    video_id: str  # the video's content hash: a remote decoder checks it holds those bytes
    index: int  # position among the video's segments
    codec: str
    # §3.2: H.264 seeks once, to the first GOP, and decodes sequentially from there
    # (an FFmpeg H.264 seek costs ~50-100 ms); other codecs seek to every GOP.
    seek_per_gop: bool
    gops: list[GopTask] = Field(min_length=1)

    @property
    def frame_indices(self) -> list[int]:
        return [i for task in self.gops for i in task.frame_indices]

    @property
    def frame_pts(self) -> list[int]:
        return [p for task in self.gops for p in task.frame_pts]

    @property
    def decode_cost(self) -> int:
        """Frames decoded to produce this segment (each GOP from its keyframe to its last target)."""
        return sum(t.frame_indices[-1] - t.first_frame + 1 for t in self.gops)


def plan_segments(index: VideoIndex, frame_indices: Sequence[int], temporal_patch_size: int,
                  num_segments: int, video_id: str = "") -> list[Segment]:
    """Split `frame_indices` (ascending) into at most `num_segments` GOP-aligned segments of
    balanced decoding cost, every segment but the last a multiple of `temporal_patch_size`."""
    frames = list(frame_indices)
    if not frames:
        raise ValueError("no frames to plan")
    if frames != sorted(set(frames)) or frames[0] < 0 or frames[-1] >= index.total_num_frames:
        raise ValueError("frame indices must be ascending, distinct and inside the video")
    if temporal_patch_size < 1 or num_segments < 1:
        raise ValueError("temporal_patch_size and num_segments must be positive")
    by_gop = [(gop, list(group)) for gop, group in groupby(frames, key=lambda f: index.gop_of(f).index)]
    cuts = _balanced_cuts(index, by_gop, num_segments)
    bounds = _align(cuts, len(frames), temporal_patch_size)
    return [_segment(index, frames[a:b], i, video_id) for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))]


def _balanced_cuts(index: VideoIndex, by_gop: list[tuple[int, list[int]]], num_segments: int) -> list[int]:
    """Positions in the flat frame list where segments start (0 first), cutting only between
    GOPs, each segment's decoding cost (frames from the keyframe to the last target) near
    an equal share."""
    costs = [frames[-1] - index.gops[gop].first_frame + 1 for gop, frames in by_gop]
    parts = min(num_segments, len(by_gop))
    total = sum(costs)
    cuts, position, acc, done = [0], 0, 0, 1
    for k, (cost, (_, frames)) in enumerate(zip(costs, by_gop, strict=True)):
        gops_left = len(by_gop) - k
        # Cut before this GOP when the running cost reached the next share, or when every
        # remaining GOP must start its own segment to make `parts` segments.
        if k and done < parts and (acc >= total * done / parts or gops_left == parts - done):
            cuts.append(position)
            done += 1
        acc += cost
        position += len(frames)
    return cuts


def _align(cuts: list[int], total: int, tps: int) -> list[int]:
    """Fig. 7b: move each cut forward (never back) so every segment but the last holds a
    multiple of `tps` frames. Segments emptied by the moves disappear."""
    bounds = [0]
    for cut in cuts[1:] + [total]:
        start = bounds[-1]
        if cut <= start:
            continue
        end = min(total, start + -(-(cut - start) // tps) * tps)
        bounds.append(end)
        if end == total:
            break
    if bounds[-1] != total:
        bounds.append(total)
    return bounds


def _segment(index: VideoIndex, frames: list[int], number: int, video_id: str) -> Segment:
    tasks = []
    for gop_index, group in groupby(frames, key=lambda f: index.gop_of(f).index):
        gop = index.gops[gop_index]
        members = list(group)
        tasks.append(GopTask(gop=gop.index, first_frame=gop.first_frame, keyframe_pts=gop.keyframe_pts, byte_offset=gop.byte_offset,
                             frame_indices=members, frame_pts=[index.frame_pts[f] for f in members]))
    return Segment(video_id=video_id, index=number, codec=index.codec, seek_per_gop=index.codec != H264, gops=tasks)
