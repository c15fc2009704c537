"""config.json files of real 7B checkpoints (sizes only: the planner reads nothing else)."""

from __future__ import annotations

import json
from pathlib import Path

QWEN2_VL_7B = {
    "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
    "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
    "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                      "hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
}

# llava-hf/llava-1.5-7b-hf: a sparse text_config (Llama defaults) and a CLIP ViT-L/14-336 tower.
LLAVA_15_7B = {
    "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "image_token_index": 32000,
    "text_config": {"model_type": "llama", "max_position_embeddings": 4096, "vocab_size": 32064},
    "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                      "num_attention_heads": 16, "num_hidden_layers": 24, "patch_size": 14,
                      "projection_dim": 768, "model_type": "clip_vision_model"},
}


def write_model(root: Path, config: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    return root
