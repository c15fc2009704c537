"""How to sample one request's tokens: shared by the router (which validates the client's
values) and the worker (which applies them). Torch-free.

Ranges follow the OpenAI API and vLLM; a value outside them is a client error, so the
model raises pydantic's ValidationError and the router turns it into a 400.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# torch.Generator.manual_seed accepts the int64 range; vLLM uses the same bounds.
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1
MAX_STOP_STRINGS = 4
MAX_STOP_STRING_CHARS = 1024  # per stop string: the matcher holds back this much text
MAX_STOP_TOKEN_IDS = 64
MAX_TOP_LOGPROBS = 20
# Below this a temperature is greedy (vLLM's _SAMPLING_EPS): dividing logits by 1e-300 gives inf/NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5
LOGIT_BIAS_LIMIT = 100.0  # OpenAI clamps each bias to [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 1024


_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, index: int) -> int:
    """splitmix64 of (seed, index) -> a non-negative int64 for torch.Generator."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of choice `choice` of an n > 1 request: choice 0 keeps the request's seed
    (so it samples what an n=1 request would), choice i draws from mix(seed, -i - 1)
    (the output-index draws of that seed use indices >= 0: no overlap)."""
    if seed is None or choice == 0:
        return seed
    return mix_seed(seed, -choice - 1)


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(default=1.0, ge=0.0, le=2.0)  # 0 = greedy
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # 0 = off
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    max_tokens: int = Field(default=16, ge=1)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)
    # Logits processors (worker/engine/sampling.py applies them in vLLM's order).
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    logit_bias: dict[int, float] = Field(default_factory=dict, max_length=MAX_LOGIT_BIAS_ENTRIES)
    min_tokens: int = Field(default=0, ge=0)
    # Sequences to generate from one prompt (OpenAI's n, or best_of): one prefill, n decodes.
    n: int = Field(default=1, ge=1, le=64)

    @field_validator("logit_bias")
    @classmethod
    def _clamped_bias(cls, bias: dict[int, float]) -> dict[int, float]:
        # OpenAI (and vLLM) clamp rather than refuse a bias outside [-100, 100].
        if any(t < 0 for t in bias):
            raise ValueError("logit_bias keys must be non-negative token ids")
        return {t: max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, b)) for t, b in bias.items()}

    @model_validator(mode="after")
    def _min_below_max(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})")
        return self

    @field_validator("temperature")
    @classmethod
    def _tiny_is_greedy(cls, temperature: float) -> float:
        return 0.0 if temperature < GREEDY_BELOW_TEMPERATURE else temperature

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, stop: list[str]) -> list[str]:
        # An empty stop string would match at once and end every request with no output.
        if any(s == "" for s in stop):
            raise ValueError("stop strings must not be empty")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
            raise ValueError(f"each stop string may be at most {MAX_STOP_STRING_CHARS} characters")
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

    def for_choice(self, choice: int, seed: int | None = None) -> SamplingParams:
        """One choice of an n > 1 request as a request of its own (n=1, its own seed stream)."""
        base = self.seed if seed is None else seed
        return self.model_copy(update={"n": 1, "seed": choice_seed(base, choice)})

    @property
    def penalized(self) -> bool:
        """Whether the repetition / frequency / presence penalties change any logit."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
