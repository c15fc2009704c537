"""Requests shared by the engine tests: chat prompts with 0-3 images of assorted sizes,
run through the torch-free processor (as the router would) and the HF reference."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_reference import make_test_image
from PIL import Image

from triptych.processor import MultimodalProcessor
from triptych.sampling_params import SamplingParams
from triptych.worker.engine import Request


@dataclass
class Item:
    """The multimodal item fields the scheduler and model runner read, for unit tests that
    build requests by hand (no processor)."""

    offset: int
    length: int
    content_hash: str
    grid_thw: tuple[int, int, int] | None = None
    kind: str = "image"


TEXTS = [
    "hi",
    "describe the picture in a few words please",
    "what is shown here and why does it matter to anyone looking at it today",
    "compare",
    "one two three four five six seven eight nine ten eleven twelve",
    "tell me a story",
    "count the red things",
    "which of these is larger, and by how much, if you had to guess",
]
SIZES = [(56, 56), (84, 56), (56, 112), (112, 84), (70, 98)]


@dataclass
class Case:
    messages: list[dict[str, Any]]
    images: list[Image.Image]


def make_cases(n: int = 8, seed: int = 0) -> list[Case]:
    """n chat requests; request i carries i % 4 images (0, 1, 2, 3, 0, ...)."""
    cases = []
    for i in range(n):
        num_images = i % 4
        images = [make_test_image(seed + 10 * i + j, *SIZES[(i + j) % len(SIZES)]) for j in range(num_images)]
        parts: list[dict[str, Any]] = [{"type": "image"} for _ in images]
        # Put the text between images sometimes, so spans sit mid-prompt.
        parts.insert(min(1, len(parts)), {"type": "text", "text": TEXTS[i % len(TEXTS)]})
        cases.append(Case([{"role": "user", "content": parts}], images))
    return cases


def to_request(proc: MultimodalProcessor, case: Case, rid: str, params: SamplingParams | None = None,
               **kw: Any) -> Request:
    p = proc.process(case.messages, case.images)
    images = {item.content_hash: img.image for item, img in zip(p.mm_items, p.images, strict=True)}
    return Request(rid, p.token_ids, params or SamplingParams(temperature=0.0, max_tokens=10),
                   mm_items=p.mm_items, images=images, **kw)


def processor(model_dir: Path) -> MultimodalProcessor:
    return MultimodalProcessor.from_pretrained(model_dir)
