"""`triptych generate`: one chat request through a local EPD engine, completion to stdout."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from triptych.cli_args import resolve_model
from triptych.processor import MultimodalProcessor, ProcessorError, UnsupportedModelError
from triptych.sampling_params import SamplingParams


def generate(model_dir: Path, prompt: str, image_paths: list[str], params: SamplingParams, *,
             dtype: str = "float32", device: str = "cpu") -> str:
    from triptych.worker.engine import Engine, EngineConfig, Request

    images = [Path(p).read_bytes() for p in image_paths]
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]
    processed = MultimodalProcessor.from_pretrained(model_dir).process([{"role": "user", "content": content}], images)
    engine = Engine(EngineConfig(model=str(model_dir), dtype=dtype, device=device, max_num_seqs=1))
    request = Request("cli", processed.token_ids, params, mm_items=processed.mm_items,
                      images={item.content_hash: img.image for item, img in
                              zip(processed.mm_items, processed.images, strict=True)})
    (done,) = engine.generate_batch([request])
    if done.error:
        raise RuntimeError(done.error)
    return done.text


def cli_main(args: argparse.Namespace) -> int:
    from triptych.worker.engine import RequestValidationError
    from triptych.worker.models.spec import UnsupportedCheckpointError

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                seed=args.seed, max_tokens=args.max_tokens)
        text = generate(resolve_model(args.model), args.prompt, args.image, params,
                        dtype=args.dtype, device=args.device)
    except (OSError, ValueError, ProcessorError, UnsupportedModelError, UnsupportedCheckpointError,
            RequestValidationError, RuntimeError) as exc:
        print(f"triptych generate: error: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0
