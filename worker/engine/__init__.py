"""The inference engine of one instance (see engine.py for the step loop)."""

from triptych.worker.engine.engine import Engine, EngineConfig
from triptych.worker.engine.request import (
    FinishReason,
    Handoff,
    ImageTooLargeError,
    InvalidImageError,
    InvalidRequestError,
    MissingEmbeddingError,
    PrefilledKV,
    PromptTooLongError,
    Request,
    RequestOutput,
    RequestStatus,
    StageNotServedError,
)

__all__ = [
    "Engine", "EngineConfig", "FinishReason", "Handoff", "ImageTooLargeError", "InvalidImageError",
    "InvalidRequestError", "MissingEmbeddingError", "PrefilledKV", "PromptTooLongError", "Request",
    "RequestOutput", "RequestStatus", "StageNotServedError",
]
