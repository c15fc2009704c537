"""The inference engine of one instance (see engine.py for the step loop)."""

from triptych.worker.engine.engine import Engine, EngineConfig
from triptych.worker.engine.request import (
    FinishReason,
    Handoff,
    ImageTooLargeError,
    InvalidImageError,
    MissingEmbeddingError,
    PrefilledKV,
    PromptTooLongError,
    Request,
    RequestOutput,
    RequestStatus,
    RequestValidationError,
    StageNotServedError,
)

__all__ = [
    "Engine", "EngineConfig", "FinishReason", "Handoff", "ImageTooLargeError", "InvalidImageError",
    "RequestValidationError", "MissingEmbeddingError", "PrefilledKV", "PromptTooLongError", "Request",
    "RequestOutput", "RequestStatus", "StageNotServedError",
]
