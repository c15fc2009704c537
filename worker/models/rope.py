"""Rotary position embeddings: 1-D RoPE (Llama/Qwen2) and Qwen's multimodal M-RoPE.

Everything here reproduces transformers' arithmetic step by step (float32 angles, the
same `rotate_half` convention, the same M-RoPE section interleave), so our language
model's logits match the reference implementation to float rounding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

from .spec import ModelSpec, RopeSpec


class MMSpan(Protocol):
    """What `prompt_positions` needs from a multimodal item (e.g. `triptych.processor.MMItem`)."""

    kind: str  # "image" or "video"
    offset: int
    length: int
    grid_thw: tuple[int, int, int] | None


def inv_freq(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """Inverse frequencies `[head_dim // 2]` (transformers `ROPE_INIT_FUNCTIONS` semantics)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    freq = 1.0 / (rope.theta**exponent)
    if rope.kind == "linear":
        freq = freq / rope.factor
    elif rope.kind == "llama3":
        freq = _llama3_scale(freq, rope)
    return freq


def _llama3_scale(freq: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / rope.factor, freq)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin(
    positions: torch.Tensor,
    freq: torch.Tensor,
    mrope_section: Sequence[int] | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables `[T, head_dim]` for `positions` `[T]` (RoPE) or `[3, T]` (M-RoPE)."""
    angles = positions[..., None].float() * freq.to(positions.device)  # [T, D/2] or [3, T, D/2]
    cos, sin = angles.cos(), angles.sin()
    if mrope_section is not None:
        if positions.dim() == 1:
            cos, sin = cos.expand(3, -1, -1), sin.expand(3, -1, -1)
        cos, sin = _interleave_sections(cos, mrope_section), _interleave_sections(sin, mrope_section)
    elif positions.dim() != 1:
        raise ValueError(f"positions must be [T] for 1-D RoPE, got {tuple(positions.shape)}")
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((sin, sin), dim=-1).to(dtype)


def _interleave_sections(table: torch.Tensor, section: Sequence[int]) -> torch.Tensor:
    # transformers Qwen2VLRotaryEmbedding.recomposition_frequencies: chunk i of the
    # frequency axis takes its angle from position axis i % 3 (t, h, w).
    chunks = table.split(list(section), dim=-1)
    return torch.cat([chunk[i % 3] for i, chunk in enumerate(chunks)], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[T, heads, head_dim]` by `cos`/`sin` `[T, head_dim]` (rotate_half convention)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# ---------------------------------------------------------------------------
# Prompt positions


def prompt_positions(
    spec: ModelSpec, token_ids: Sequence[int], mm_items: Sequence[MMSpan]
) -> tuple[torch.Tensor, int]:
    """Positions of a prompt and the delta for later tokens.

    Qwen (M-RoPE): `[3, L]` positions following transformers' `get_rope_index`: text runs
    count up on all three axes; an image/video of LLM grid (t, h, w) gets
    (start + t * interval, start + row, start + col), after which the text position
    advances by max(h, w) only. Returns delta = max(position) + 1 - L, so the token at
    index i >= L sits at position i + delta on all three axes.
    LLaVA (1-D RoPE): `[L]` arange and delta 0.
    """
    length = len(token_ids)
    if not spec.uses_mrope:
        return torch.arange(length, dtype=torch.long), 0
    pieces: list[torch.Tensor] = []
    cursor = 0  # next token index not yet given a position
    current = 0  # next text position
    for item in sorted(mm_items, key=lambda it: it.offset):
        if item.offset < cursor or item.offset + item.length > length:
            raise ValueError(
                f"multimodal item at offset {item.offset} (length {item.length}) overlaps another "
                f"or runs past the prompt ({length} tokens)"
            )
        text_len = item.offset - cursor
        pieces.append(torch.arange(text_len, dtype=torch.long).expand(3, -1) + current)
        current += text_len
        grid, step = _vision_positions(spec, item, current)
        pieces.append(grid)
        current += step
        cursor = item.offset + item.length
    pieces.append(torch.arange(length - cursor, dtype=torch.long).expand(3, -1) + current)
    positions = torch.cat(pieces, dim=1)
    delta = int(positions.max().item()) + 1 - length if length else 0
    return positions, delta


def decode_positions(spec: ModelSpec, start: int, count: int, delta: int) -> torch.Tensor:
    """Positions of tokens at indices start..start+count-1 after the prompt."""
    pos = torch.arange(start, start + count, dtype=torch.long) + delta
    return pos.expand(3, -1).clone() if spec.uses_mrope else pos


def _vision_positions(spec: ModelSpec, item: MMSpan, start: int) -> tuple[torch.Tensor, int]:
    if item.grid_thw is None:
        raise ValueError(f"{item.kind} item at offset {item.offset} has no grid_thw (needed for M-RoPE)")
    t, h, w = (int(v) for v in item.grid_thw)
    merge = spec.spatial_merge_size
    llm_h, llm_w = h // merge, w // merge
    if t * llm_h * llm_w != item.length:
        raise ValueError(
            f"{item.kind} at offset {item.offset}: grid {t}x{h}x{w} gives {t * llm_h * llm_w} tokens "
            f"after {merge}x{merge} merging but the placeholder run has {item.length}"
        )
    interval: float | torch.Tensor = 1.0
    if item.kind == "video" and spec.tokens_per_second is not None:
        # Qwen2.5-VL: temporal ids spaced by tokens_per_second * seconds per temporal grid, in
        # float32 as transformers (second_per_grid_ts is a float32 tensor there) before truncating.
        seconds = torch.tensor(float(getattr(item, "second_per_grid_t", 1.0) or 1.0), dtype=torch.float32)
        interval = spec.tokens_per_second * seconds
    temporal = (torch.arange(t) * interval).long() + start
    rows = torch.arange(llm_h) + start
    cols = torch.arange(llm_w) + start
    tt, hh, ww = torch.meshgrid(temporal, rows, cols, indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1), max(h, w) // merge
