"""The worker's model layer: checkpoint spec and loader, our language model over a
paged KV cache, RoPE / M-RoPE positions, and the vision encoders."""

from .language import LanguageModel
from .loader import LoadedModel, canonical_key, load_model
from .rope import decode_positions, prompt_positions
from .spec import ModelSpec, RopeSpec, UnsupportedCheckpointError, read_spec
from .vision import LlavaVisionModel, QwenVisionModel, VisionInput, VisionModel

__all__ = [
    "LanguageModel",
    "LlavaVisionModel",
    "LoadedModel",
    "ModelSpec",
    "QwenVisionModel",
    "RopeSpec",
    "UnsupportedCheckpointError",
    "VisionInput",
    "VisionModel",
    "canonical_key",
    "decode_positions",
    "load_model",
    "prompt_positions",
    "read_spec",
]
