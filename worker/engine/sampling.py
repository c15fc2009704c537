"""Token sampling: greedy, temperature, top-k, top-p, seeds, logprobs.

Reproducibility across batches and instances: the random draw for output token `i` of a
request comes from a generator seeded with `mix(seed, i)` (splitmix64), so a seeded request
samples the same tokens whatever it is batched with, and a P instance (token 0) and a D
instance (tokens 1..) of one request draw from one stream. The draw is Gumbel-max in its
exponential form: `argmax(p / q)` with `q ~ Exp(1)` equals a sample from `p`. Unseeded
non-greedy requests get a random seed at admission (`resolve_seed`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from triptych.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, index: int) -> int:
    """splitmix64 of (seed, index) -> a non-negative int64 for torch.Generator."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def resolve_seed(params: SamplingParams) -> int | None:
    if params.greedy:
        return None
    return params.seed if params.seed is not None else random.getrandbits(63)


@dataclass
class SampleRow:
    """One row of logits to sample: its parameters, seed and output index."""

    params: SamplingParams
    seed: int | None
    index: int


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict | None]  # per row: {"token": id, "logprob": x, "top": [(id, x), ...]} or None


def _filter_logits(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Temperature, top-k and top-p on the rows that sample (float32, batched)."""
    temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype, device=logits.device)
    logits = logits / temps.unsqueeze(1)
    vocab = logits.shape[1]
    top_ks = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
    top_ps = [r.params.top_p for r in rows]
    if all(k == vocab for k in top_ks) and all(p >= 1.0 for p in top_ps):
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.tensor(top_ks, device=logits.device).unsqueeze(1)
    drop = ranks >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=1)
    # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
    before = probs.cumsum(dim=1) - probs
    p = torch.tensor(top_ps, dtype=probs.dtype, device=logits.device).unsqueeze(1)
    drop |= before >= p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def _exponential_noise(rows: list[SampleRow], vocab: int, device: torch.device) -> torch.Tensor:
    # Drawn on CPU so every device and batch gives the same numbers for (seed, index).
    noise = torch.empty(len(rows), vocab)
    gen = torch.Generator()
    for i, r in enumerate(rows):
        gen.manual_seed(mix_seed(r.seed or 0, r.index))
        noise[i].exponential_(generator=gen)
    return noise.to(device)


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: list[SampleRow]) -> list[dict | None]:
    if not any(r.params.logprobs for r in rows):
        return [None] * len(rows)
    lp = logits.log_softmax(dim=1)
    out: list[dict | None] = []
    for i, r in enumerate(rows):
        if not r.params.logprobs:
            out.append(None)
            continue
        tok = int(tokens[i])
        entry: dict = {"token": tok, "logprob": float(lp[i, tok]), "top": []}
        if r.params.top_logprobs:
            vals, ids = lp[i].topk(r.params.top_logprobs)
            entry["top"] = [(int(t), float(v)) for t, v in zip(ids.tolist(), vals.tolist(), strict=True)]
        out.append(entry)
    return out


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
    """Sample one token per row of `logits` `[N, V]` (float32)."""
    tokens = logits.argmax(dim=1)
    rand_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if rand_rows:
        sub = [rows[i] for i in rand_rows]
        idx = torch.tensor(rand_rows, device=logits.device)
        probs = _filter_logits(logits[idx], sub).softmax(dim=1)
        noise = _exponential_noise(sub, logits.shape[1], logits.device)
        tokens[idx] = (probs / noise).argmax(dim=1)
    return SampleResult(tokens.tolist(), _logprobs(logits, tokens, rows))
