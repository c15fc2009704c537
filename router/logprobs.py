"""Log-probs in OpenAI's response shapes (the worker sends token ids and numbers:
`triptych.stage_protocol.TokenLogprob`).

- chat: `choices[].logprobs.content[]` = {token, logprob, bytes, top_logprobs[]}, the
  alternatives being the `top_logprobs` most likely tokens;
- completions: `choices[].logprobs` = {tokens, token_logprobs, top_logprobs, text_offset},
  each `top_logprobs` entry a {token text: logprob} dict of the top `logprobs` tokens plus
  the sampled one (vLLM's shape), `text_offset` each token's character offset in the text.

A token's text is its own detokenization (special tokens included), as vLLM reports it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from triptych.stage_protocol import TokenLogprob

TokenText = Callable[[int], str]


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_content(entries: Sequence[TokenLogprob], token_text: TokenText) -> list[dict[str, Any]]:
    """The `logprobs.content` items of these tokens."""
    out = []
    for e in entries:
        text = token_text(e.token)
        top = [{"token": (t := token_text(tok)), "logprob": lp, "bytes": _bytes(t)} for tok, lp in e.top]
        out.append({"token": text, "logprob": e.logprob, "bytes": _bytes(text), "top_logprobs": top})
    return out


def completion_logprobs(entries: Sequence[TokenLogprob], token_text: TokenText, offset: int
                        ) -> tuple[dict[str, Any], int]:
    """The `logprobs` object of these tokens, whose text starts at `offset`; and the offset after them."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for e in entries:
        text = token_text(e.token)
        top = {token_text(tok): lp for tok, lp in e.top}
        top.setdefault(text, e.logprob)
        tokens.append(text)
        token_logprobs.append(e.logprob)
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}, offset
