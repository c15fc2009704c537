"""How to sample one request's tokens: shared by the router (which validates the client's
values) and the worker (which applies them). Torch-free.

Ranges follow the OpenAI API and vLLM; a value outside them is a client error, so the
model raises pydantic's ValidationError and the router turns it into a 400.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

# torch.Generator.manual_seed accepts the int64 range; vLLM uses the same bounds.
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1
MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(default=1.0, ge=0.0, le=2.0)  # 0 = greedy
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # 0 = off
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    max_tokens: int = Field(default=16, ge=1)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, stop: list[str]) -> list[str]:
        # An empty stop string would match at once and end every request with no output.
        if any(s == "" for s in stop):
            raise ValueError("stop strings must not be empty")
        return stop

    @field_validator("stop_token_ids")
    @classmethod
    def _non_negative_ids(cls, ids: list[int]) -> list[int]:
        if any(i < 0 for i in ids):
            raise ValueError("stop_token_ids must be non-negative token ids")
        return ids

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
