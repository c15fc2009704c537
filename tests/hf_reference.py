"""Hugging Face transformers as the ground truth for parity tests.

`hf_generate` runs the checkpoint through the family's `*ForConditionalGeneration` and
the real HF processor (chat template, image processor, placeholder expansion), greedy,
fp32, batch 1, and returns only the new token ids. Engine and serving tests compare
their tokens against it.

Qwen's HF processor classes cannot be built by `AutoProcessor` without torchvision (the
video processor needs it, and torchvision is not installable next to our torch). For
those, `hf_processor` builds the same processor class restricted to images: the image
processor, tokenizer, chat template and placeholder expansion are transformers' own code.
"""

from __future__ import annotations

import io
import json
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

_LOCK = threading.Lock()


def make_test_image(seed: int, width: int, height: int) -> Image.Image:
    """A deterministic RGB image: a colour gradient (so resizing is smooth) plus seeded noise
    (so different seeds give different embeddings)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([
        255 * x / max(width - 1, 1),
        255 * y / max(height - 1, 1),
        np.full_like(x, 40.0 * (seed % 6)),
    ], axis=-1)
    noise = rng.normal(0.0, 40.0, size=(height, width, 3))
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), mode="RGB")


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _model_type(model_dir: str) -> str:
    return json.loads((Path(model_dir) / "config.json").read_text())["model_type"]


def _image_only(processor_cls: type) -> type:
    """`processor_cls` without its video processor (see the module docstring)."""

    class ImageOnly(processor_cls):  # type: ignore[misc, valid-type]
        def __init__(self, image_processor: Any = None, tokenizer: Any = None,
                     chat_template: str | None = None, **kwargs: Any) -> None:
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    ImageOnly.__name__ = f"{processor_cls.__name__}ImageOnly"
    return ImageOnly


@lru_cache(maxsize=8)
def hf_processor(model_dir: str) -> Any:
    import transformers

    model_type = _model_type(model_dir)
    if model_type in ("qwen2_vl", "qwen2_5_vl"):
        cls = (transformers.Qwen2VLProcessor if model_type == "qwen2_vl"
               else transformers.Qwen2_5_VLProcessor)
        return _image_only(cls)(
            image_processor=transformers.AutoImageProcessor.from_pretrained(model_dir),
            tokenizer=transformers.AutoTokenizer.from_pretrained(model_dir),
            chat_template=(Path(model_dir) / "chat_template.jinja").read_text(),
        )
    return transformers.AutoProcessor.from_pretrained(model_dir)


_MODEL_CLASSES = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
}


@lru_cache(maxsize=4)
def hf_model(model_dir: str) -> Any:
    import torch
    import transformers

    cls = getattr(transformers, _MODEL_CLASSES[_model_type(model_dir)])
    model = cls.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model


def hf_inputs(model_dir: str, messages: list[dict], images: list[Image.Image],
              **chat_kwargs: Any) -> dict[str, Any]:
    """What the HF processor feeds the model: input_ids, pixel values, grids, mm_token_type_ids."""
    processor = hf_processor(str(model_dir))
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **chat_kwargs)
    return processor(text=[text], images=list(images) or None, return_tensors="pt")


def hf_prompt_ids(model_dir: str | Path, messages: list[dict], images: list[Image.Image],
                  **chat_kwargs: Any) -> list[int]:
    return hf_inputs(str(model_dir), messages, images, **chat_kwargs)["input_ids"][0].tolist()


def hf_generate(model_dir: str | Path, messages: list[dict], images: list[Image.Image],
                max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
    """Greedy completion token ids (prompt excluded), fp32, batch 1; stops at EOS unless
    `ignore_eos` (vLLM's meaning: EOS may be generated, it just does not stop)."""
    import copy

    import torch
    from transformers.utils import logging as hf_logging

    model_dir = str(model_dir)
    with _LOCK, torch.inference_mode():
        model = hf_model(model_dir)
        inputs = hf_inputs(model_dir, messages, images)
        config = copy.deepcopy(model.generation_config)
        if ignore_eos:
            config.pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0
            config.eos_token_id = [-1]  # no token stops it (None falls back to the model's EOS)
        config.update(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, repetition_penalty=1.0)
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # it warns on the -1 EOS of every ignore_eos call
        try:
            out = model.generate(**inputs, generation_config=config)
        finally:
            hf_logging.set_verbosity(verbosity)
        return out[0, inputs["input_ids"].shape[1]:].tolist()


def hf_next_token_logits(model_dir: str | Path, messages: list[dict],
                         images: list[Image.Image]) -> Any:
    """Float32 logits of the first generated position, shape [vocab]."""
    import torch

    model_dir = str(model_dir)
    with _LOCK, torch.inference_mode():
        model = hf_model(model_dir)
        inputs = hf_inputs(model_dir, messages, images)
        return model(**inputs).logits[0, -1].float()
