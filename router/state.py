"""What the router's HTTP layer shares across requests (one per app)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from triptych.processor import MultimodalProcessor
from triptych.router.backend import Backend
from triptych.router.config import RouterConfig
from triptych.router.images import ImageLoader
from triptych.router.metrics import FrontendMetrics
from triptych.router.streaming import Detokenizer


@dataclass
class RouterState:
    config: RouterConfig
    backend: Backend
    processor: MultimodalProcessor
    metrics: FrontendMetrics
    images: ImageLoader
    api_keys: frozenset[str]
    max_model_len: int
    placeholder_ids: frozenset[int]
    admin_token: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        return self.config.model_name

    def detokenizer(self, skip_special_tokens: bool) -> Detokenizer:
        return self.processor.detokenizer(skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's own text for logprobs (special tokens spelled out, as vLLM does)."""
        return self.processor.decode([token_id], skip_special_tokens=False)
