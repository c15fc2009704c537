"""A model's sizes, parsed from its config.json without transformers (the planner runs in
the operator, which imports neither torch nor the worker's model code).

`worker/models/spec.py:read_spec` goes through transformers' AutoConfig (and so torch) and
carries no vision sizes, so it is not used here. Defaults for fields a sparse config
leaves out are transformers' own (LLaVA's text_config is Llama's, its vision tower CLIP's).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

_LLAMA_DEFAULTS = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "vocab_size": 32000}
_CLIP_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                  "num_attention_heads": 12, "image_size": 224, "patch_size": 32}


class ModelShapeError(ValueError):
    """config.json is missing or describes a model family the planner does not know."""


class ModelShape(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    family: str
    # language model
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    # vision tower
    vision_layers: int
    vision_hidden: int
    vision_intermediate: int
    vision_heads: int
    patch_size: int
    merge_size: int  # Qwen: 2x2 patches -> one token; LLaVA: 1
    fixed_image_size: int | None = None  # LLaVA resizes every image to this square
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    # --- sizes the simulator and the roofline need ------------------------------------
    @property
    def lm_linear_params(self) -> int:
        """Weights of one decoder layer's matmuls (q, k, v, o, gate, up, down)."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attn = h * self.num_heads * self.head_dim * 2 + h * kv * 2
        return attn + 3 * h * self.intermediate_size

    @property
    def lm_params(self) -> int:
        return self.num_layers * self.lm_linear_params + 2 * self.vocab_size * self.hidden_size

    @property
    def vision_linear_params(self) -> int:
        """One vision block: qkv + o + a two-matmul MLP."""
        return 4 * self.vision_hidden ** 2 + 2 * self.vision_hidden * self.vision_intermediate

    @property
    def vision_params(self) -> int:
        merger = (self.vision_hidden * self.merge_size ** 2) ** 2 + \
            self.vision_hidden * self.merge_size ** 2 * self.hidden_size
        return self.vision_layers * self.vision_linear_params + merger

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def embedding_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return self.hidden_size * dtype_bytes

    def patches_per_image(self, width: int, height: int) -> int:
        """Vision-tower sequence length of one image."""
        if self.fixed_image_size is not None:
            return (self.fixed_image_size // self.patch_size) ** 2
        h, w = self._resized(width, height)
        return (h // self.patch_size) * (w // self.patch_size)

    def tokens_per_image(self, width: int, height: int) -> int:
        """LLM tokens (placeholders) one image expands to."""
        return max(1, self.patches_per_image(width, height) // self.merge_size ** 2)

    def _resized(self, width: int, height: int) -> tuple[int, int]:
        """Qwen2-VL's smart_resize: sides to multiples of patch*merge, pixels within bounds."""
        f = self.patch_size * self.merge_size
        h, w = max(f, round(height / f) * f), max(f, round(width / f) * f)
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
        return h, w


def read_shape(model_dir: str | Path) -> ModelShape:
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelShapeError(f"cannot read {path}: {exc}") from None
    return shape_of(config, _read_optional(Path(model_dir) / "preprocessor_config.json"), str(path))


def shape_of(config: dict[str, Any], pre: dict[str, Any] | None = None, where: str = "config.json") -> ModelShape:
    """The shape from a checkpoint's config.json (and preprocessor_config.json) contents."""
    kind = config.get("model_type", "")
    try:
        if kind in ("qwen2_vl", "qwen2_5_vl"):
            return _qwen(config, pre or {}, kind)
        if kind == "llava":
            return _llava(config)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelShapeError(f"{where}: not a complete {kind} config ({type(exc).__name__}: {exc})") from None
    raise ModelShapeError(f"{where}: model_type {kind!r} is not one the planner knows "
                          "(qwen2_vl, qwen2_5_vl, llava)")


def _read_optional(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _lm_fields(text: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    get = lambda k: text.get(k, defaults.get(k))  # noqa: E731
    heads = int(get("num_attention_heads"))
    hidden = int(get("hidden_size"))
    return dict(num_layers=int(get("num_hidden_layers")), hidden_size=hidden, num_heads=heads,
                num_kv_heads=int(text.get("num_key_value_heads") or heads),
                head_dim=int(text.get("head_dim") or hidden // heads),
                intermediate_size=int(get("intermediate_size")), vocab_size=int(get("vocab_size")))


def _qwen(config: dict[str, Any], pre: dict[str, Any], kind: str) -> ModelShape:
    text = config.get("text_config") or config  # flat (released) or nested (transformers 5) layout
    vis = config.get("vision_config", {})
    if kind == "qwen2_vl":
        v_hidden = int(vis.get("embed_dim", 1280))
        v_inter = int(v_hidden * vis.get("mlp_ratio", 4))
    else:
        v_hidden = int(vis.get("hidden_size", 1280))
        v_inter = int(vis.get("intermediate_size", 3420))
    return ModelShape(
        family=kind.replace("_", "-").replace("2-5", "2.5"), **_lm_fields(text, {}),
        vision_layers=int(vis.get("depth", 32)), vision_hidden=v_hidden, vision_intermediate=v_inter,
        vision_heads=int(vis.get("num_heads", 16)), patch_size=int(vis.get("patch_size", 14)),
        merge_size=int(vis.get("spatial_merge_size", 2)),
        min_pixels=int(pre.get("min_pixels", 56 * 56)), max_pixels=int(pre.get("max_pixels", 28 * 28 * 1280)))


def _llava(config: dict[str, Any]) -> ModelShape:
    text, vis = config.get("text_config", {}), config.get("vision_config", {})
    v = {k: vis.get(k, d) for k, d in _CLIP_DEFAULTS.items()}
    return ModelShape(
        family="llava", **_lm_fields(text, _LLAMA_DEFAULTS),
        vision_layers=int(v["num_hidden_layers"]), vision_hidden=int(v["hidden_size"]),
        vision_intermediate=int(v["intermediate_size"]), vision_heads=int(v["num_attention_heads"]),
        patch_size=int(v["patch_size"]), merge_size=1, fixed_image_size=int(v["image_size"]))
