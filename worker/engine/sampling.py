"""Token sampling: logits processors, greedy, temperature, min-p, top-k, top-p, seeds, logprobs.

Order (vLLM v1's Sampler, so a request gives the same tokens as on vLLM): first the
processors that can change the argmax - `min_tokens` (EOS and stop tokens masked until
the minimum is reached), `logit_bias`, then the penalties (repetition over prompt +
output tokens; frequency and presence over output tokens) - then greedy rows take the
argmax; sampling rows divide by the temperature, drop tokens under `min_p` times the top
probability, then apply top-k and top-p. Log-probs are those of the processed logits
before temperature (so a greedy request's equal the model's log-softmax).

Reproducibility across batches and instances: the random draw for output token `i` of a
request comes from a generator seeded with `mix(seed, i)` (splitmix64), so a seeded request
samples the same tokens whatever it is batched with, and a P instance (token 0) and a D
instance (tokens 1..) of one request draw from one stream. The draw is Gumbel-max in its
exponential form: `argmax(p / q)` with `q ~ Exp(1)` equals a sample from `p`. Unseeded
non-greedy requests get a random seed at admission (`resolve_seed`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from triptych.sampling_params import SamplingParams, choice_seed, mix_seed  # noqa: F401 (re-exported)


def resolve_seed(params: SamplingParams) -> int | None:
    if params.greedy:
        return None
    return params.seed if params.seed is not None else random.getrandbits(63)


@dataclass
class SampleRow:
    """One row of logits to sample: its parameters, seed and output index. The penalties
    read the request's prompt and output tokens; `min_tokens` masks `stop_ids` (EOS and
    the request's stop tokens) while fewer than that many tokens were sampled."""

    params: SamplingParams
    seed: int | None
    index: int
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    stop_ids: frozenset[int] = frozenset()


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict | None]  # per row: {"token": id, "logprob": x, "top": [(id, x), ...]} or None


def _padded_ids(ids: list[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """`[N, L]` token ids, each row padded with `pad` (a column past the vocabulary)."""
    width = max((len(x) for x in ids), default=0)
    padded = torch.full((len(ids), width + 1), pad, dtype=torch.long)
    for i, x in enumerate(ids):
        if len(x):
            padded[i, :len(x)] = torch.as_tensor(x, dtype=torch.long)
    return padded.to(device)


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """vLLM's `apply_penalties` (vllm/model_executor/layers/utils.py) on the penalized rows:
    a token seen in the prompt or output has a positive logit divided by
    `repetition_penalty` and a negative one multiplied by it; then each output
    occurrence subtracts `frequency_penalty`, and appearing at all `presence_penalty`.

    Computed sparsely, over the rows' token ids rather than the vocabulary (a gather and
    a scatter per penalty): a repeated id reads and writes the same value, so it counts
    once where it must (repetition, presence) and per occurrence where it must (frequency)."""
    which = [i for i, r in enumerate(rows) if r.params.penalized]
    if not which:
        return logits
    sub = [rows[i] for i in which]
    idx = torch.tensor(which, device=logits.device)
    vocab = logits.shape[1]
    # One spare column for the padding ids, dropped at the end.
    x = torch.cat([logits[idx], logits.new_zeros(len(sub), 1)], dim=1)

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=x.dtype, device=x.device).unsqueeze(1)

    seen = _padded_ids([[*r.prompt_ids, *r.output_ids] for r in sub], vocab, logits.device)
    rep = column([r.params.repetition_penalty for r in sub])
    g = x.gather(1, seen)
    x.scatter_(1, seen, torch.where(g > 0, g / rep, g * rep))
    out = _padded_ids([r.output_ids for r in sub], vocab, logits.device)
    x.scatter_add_(1, out, (-column([r.params.frequency_penalty for r in sub])).expand(out.shape).contiguous())
    x.scatter_(1, out, x.gather(1, out) - column([r.params.presence_penalty for r in sub]))
    logits = logits.clone()
    logits[idx] = x[:, :vocab]
    return logits


def apply_min_tokens_and_bias(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """`min_tokens` (stop tokens to -inf below the minimum) and `logit_bias` (added)."""
    mask_r: list[int] = []
    mask_t: list[int] = []
    bias_r: list[int] = []
    bias_t: list[int] = []
    bias_v: list[float] = []
    for i, r in enumerate(rows):
        if len(r.output_ids) < r.params.min_tokens:
            mask_r += [i] * len(r.stop_ids)
            mask_t += sorted(r.stop_ids)
        for tok, b in r.params.logit_bias.items():
            bias_r.append(i)
            bias_t.append(tok)
            bias_v.append(b)
    if not mask_r and not bias_r:
        return logits
    logits = logits.clone()
    dev = logits.device
    if bias_r:
        logits.index_put_((torch.tensor(bias_r, device=dev), torch.tensor(bias_t, device=dev)),
                          torch.tensor(bias_v, dtype=logits.dtype, device=dev), accumulate=True)
    if mask_r:
        logits[torch.tensor(mask_r, device=dev), torch.tensor(mask_t, device=dev)] = float("-inf")
    return logits


def process_logits(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """The argmax-changing processors in vLLM v1's order: min_tokens, logit_bias, penalties."""
    return apply_penalties(apply_min_tokens_and_bias(logits, rows), rows)


def apply_min_p(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """vLLM's min-p: drop tokens whose probability is under `min_p` times the top one's."""
    min_ps = [r.params.min_p for r in rows]
    if not any(min_ps):
        return logits
    probs = logits.softmax(dim=1)
    threshold = probs.amax(dim=1, keepdim=True) * torch.tensor(min_ps, dtype=probs.dtype,
                                                               device=logits.device).unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _filter_logits(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Temperature, min-p, top-k and top-p on the rows that sample (float32, batched)."""
    temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype, device=logits.device)
    logits = apply_min_p(logits / temps.unsqueeze(1), rows)
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
    # -inf (a masked token) is not JSON: vLLM reports -9999.0 instead.
    lp = logits.log_softmax(dim=1).clamp_min(-9999.0)
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
    logits = process_logits(logits, rows)
    tokens = logits.argmax(dim=1)
    rand_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if rand_rows:
        sub = [rows[i] for i in rand_rows]
        idx = torch.tensor(rand_rows, device=logits.device)
        probs = _filter_logits(logits[idx], sub).softmax(dim=1)
        noise = _exponential_noise(sub, logits.shape[1], logits.device)
        tokens[idx] = (probs / noise).argmax(dim=1)
    return SampleResult(tokens.tolist(), _logprobs(logits, tokens, rows))
