"""Vision encoders: transformers' own towers, driven by our batching.

Qwen2-VL / Qwen2.5-VL reuse `Qwen2VisionTransformerPretrainedModel` /
`Qwen2_5_VisionTransformerPretrainedModel` (patch embed, blocks, 2x2 merger); LLaVA
reuses `CLIPVisionModel` + `LlavaMultiModalProjector`. Preprocessing is the
checkpoint's image processor (transformers' PIL implementation). `encode` runs the
images of several requests in one tower call and splits the output per image.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .spec import ModelSpec, UnsupportedCheckpointError


@dataclass
class VisionInput:
    """One preprocessed image (or video): what `encode` consumes."""

    pixel_values: torch.Tensor  # Qwen: [patches, C*T*P*P]; LLaVA: [3, H, W]
    grid_thw: tuple[int, int, int] | None  # Qwen patch grid (t, h, w); None for LLaVA
    num_tokens: int  # LLM embedding rows this input yields


class VisionModel(nn.Module):
    """Common surface of the vision encoders (see the family subclasses)."""

    def __init__(self, spec: ModelSpec, processor: Any) -> None:
        super().__init__()
        self.spec = spec
        self.processor = processor

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def preprocess(self, image: Any) -> VisionInput:
        raise NotImplementedError

    def preprocess_video(self, frames: Sequence[Any]) -> VisionInput:
        raise NotImplementedError(f"{self.spec.family} does not take video input")

    def encode(self, batch: Sequence[VisionInput]) -> list[torch.Tensor]:
        raise NotImplementedError


class QwenVisionModel(VisionModel):
    """Qwen2-VL / Qwen2.5-VL vision transformer with its patch merger (`visual.*` weights)."""

    def __init__(self, spec: ModelSpec, hf_config: Any, processor: Any) -> None:
        super().__init__(spec, processor)
        self.visual = _build(_qwen_tower(spec.family), hf_config.vision_config)
        self.merge = spec.spatial_merge_size

    def preprocess(self, image: Any) -> VisionInput:
        out = self.processor(images=[image], return_tensors="pt")
        t, h, w = (int(v) for v in out["image_grid_thw"][0])
        return VisionInput(out["pixel_values"], (t, h, w), t * h * w // self.merge**2)

    def preprocess_video(self, frames: Sequence[Any]) -> VisionInput:
        """Frames (same size, already sampled) -> one video input with grid t = frames / 2.

        Each frame is resized and normalised by the image processor (so frame sizing follows
        its pixel limits, not those of transformers' torchvision-only video processor); the
        frames are then grouped `temporal_patch_size` at a time in the layout of
        transformers' Qwen2VLVideoProcessor.patchify, repeating the last frame to fill the
        final group. A 2-frame video of one image equals that image's input.
        """
        if not frames:
            raise ValueError("a video needs at least one frame")
        out = self.processor(images=list(frames), return_tensors="pt")
        grids = {tuple(int(v) for v in g) for g in out["image_grid_thw"]}
        if len(grids) != 1:
            raise ValueError(f"video frames resize to different grids: {sorted(grids)}")
        _, h, w = grids.pop()
        temporal = self.visual.config.temporal_patch_size
        # Per frame: [h*w, C, temporal, P, P] with the frame broadcast over `temporal`.
        per_frame = out["pixel_values"].view(len(frames), h * w, -1, temporal, self.visual.config.patch_size**2)
        frames_t = list(per_frame[:, :, :, 0].unbind(0))
        frames_t += [frames_t[-1]] * (-len(frames_t) % temporal)
        groups = [torch.stack(frames_t[i : i + temporal], dim=2) for i in range(0, len(frames_t), temporal)]
        pixels = torch.cat([g.reshape(h * w, -1) for g in groups])
        t = len(groups)
        return VisionInput(pixels, (t, h, w), t * h * w // self.merge**2)

    def video_input(self, pixel_values_videos: Any, grid_thw: tuple[int, int, int]) -> VisionInput:
        """A video already patchified by `triptych.video_processing` (transformers' video
        processor arithmetic, pixel bounds from the video processor config; possibly built on
        a V instance) as an input of `encode`: the tower treats it like an image with t > 1."""
        pixels = torch.as_tensor(pixel_values_videos)
        t, h, w = (int(v) for v in grid_thw)
        if pixels.dim() != 2 or pixels.shape[0] != t * h * w:
            raise ValueError(f"video patches {tuple(pixels.shape)} do not match grid {t}x{h}x{w}")
        return VisionInput(pixels, (t, h, w), t * h * w // self.merge**2)

    @torch.no_grad()  # not inference_mode: callers write the outputs into caches in place
    def encode(self, batch: Sequence[VisionInput]) -> list[torch.Tensor]:
        if not batch:
            return []
        for item in batch:
            if item.grid_thw is None:
                raise ValueError("Qwen vision input needs grid_thw")
        pixels = torch.cat([item.pixel_values for item in batch]).to(self.device, self.dtype)
        grid = torch.tensor([item.grid_thw for item in batch], dtype=torch.long, device=self.device)
        # One tower call: attention stays within each image (cu_seqlens from grid_thw).
        merged = self.visual(pixels, grid_thw=grid).pooler_output
        return list(merged.to(self.dtype).split([item.num_tokens for item in batch]))


class LlavaVisionModel(VisionModel):
    """CLIP vision tower + LLaVA projector (`vision_tower.*`, `multi_modal_projector.*`)."""

    def __init__(self, spec: ModelSpec, hf_config: Any, processor: Any) -> None:
        super().__init__(spec, processor)
        from transformers import CLIPVisionModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        vision_config = copy.deepcopy(hf_config.vision_config)
        if getattr(vision_config, "model_type", None) != "clip_vision_model":
            raise UnsupportedCheckpointError(
                f"LLaVA vision tower {vision_config.model_type!r} is not supported (only clip_vision_model)"
            )
        layers = vision_config.num_hidden_layers
        feature = hf_config.vision_feature_layer
        # hidden_states has layers + 1 entries (embeddings, then each layer's output).
        self.feature_layers = [i % (layers + 1) for i in ([feature] if isinstance(feature, int) else feature)]
        self.multi_feature = not isinstance(feature, int)
        # Layers after the deepest selected one never influence the output: do not build them.
        vision_config.num_hidden_layers = max(self.feature_layers)
        self.vision_tower = _build(CLIPVisionModel, vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(hf_config)
        self.drop_cls = hf_config.vision_feature_select_strategy == "default"
        self.patch_size = vision_config.patch_size

    def preprocess(self, image: Any) -> VisionInput:
        pixels = self.processor(images=[image], return_tensors="pt")["pixel_values"][0]
        patches = (pixels.shape[-2] // self.patch_size) * (pixels.shape[-1] // self.patch_size)
        return VisionInput(pixels, None, patches + (0 if self.drop_cls else 1))

    @torch.no_grad()  # not inference_mode: callers write the outputs into caches in place
    def encode(self, batch: Sequence[VisionInput]) -> list[torch.Tensor]:
        results: list[torch.Tensor | None] = [None] * len(batch)
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for index, item in enumerate(batch):
            by_shape.setdefault(tuple(item.pixel_values.shape), []).append(index)
        for indices in by_shape.values():
            pixels = torch.stack([batch[i].pixel_values for i in indices]).to(self.device, self.dtype)
            for i, features in zip(indices, self._encode_same_size(pixels), strict=True):
                results[i] = features
        return [r for r in results if r is not None]

    def _encode_same_size(self, pixels: torch.Tensor) -> torch.Tensor:
        # Same selection as transformers' LlavaModel.get_image_features.
        hidden = self.vision_tower(pixels, output_hidden_states=True).hidden_states
        selected = [hidden[i][:, 1:] if self.drop_cls else hidden[i] for i in self.feature_layers]
        features = torch.cat(selected, dim=-1) if self.multi_feature else selected[0]
        return self.multi_modal_projector(features).to(self.dtype)


def build_vision_model(spec: ModelSpec, hf_config: Any, model_dir: Path) -> VisionModel:
    processor = load_image_processor(model_dir)
    if spec.family == "llava":
        return LlavaVisionModel(spec, hf_config, processor)
    return QwenVisionModel(spec, hf_config, processor)


def _qwen_tower(family: str) -> Any:
    if family == "qwen2-vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

        return Qwen2VisionTransformerPretrainedModel
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    return Qwen2_5_VisionTransformerPretrainedModel


def warm_imports(spec: ModelSpec, model_dir: Path) -> None:
    """What building a vision tower first imports (transformers' image-processing and
    vision modules: 0.5 s of CPU here, four times that at a quarter of a core), done once
    in an instance built without one, so that its first switch to E loads only weights.
    A checkpoint whose image processor does not load has nothing to warm: a switch to E
    says why."""
    try:
        load_image_processor(model_dir)
    except UnsupportedCheckpointError:
        return
    if spec.family == "llava":
        from transformers.models.llava import modeling_llava  # noqa: F401  (CLIP's and the projector's)
    else:
        _qwen_tower(spec.family)


def load_image_processor(model_dir: Path) -> Any:
    if not (model_dir / "preprocessor_config.json").is_file():
        raise UnsupportedCheckpointError(f"{model_dir}: no preprocessor_config.json (image processor)")
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(str(model_dir), local_files_only=True)
    except (ValueError, OSError, ImportError) as exc:
        raise UnsupportedCheckpointError(f"{model_dir}: cannot load the image processor: {exc}") from exc


def _build(cls: Any, config: Any) -> nn.Module:
    """Construct a transformers tower without random init: the checkpoint overwrites it."""
    config = copy.deepcopy(config)
    config._attn_implementation = "sdpa"
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: plain construction is only slower
        return cls._from_config(config).eval()
    with no_init_weights():
        return cls._from_config(config).eval()
