"""`triptych bench throughput`: closed-loop text load against any OpenAI-compatible server
(a Triptych router, vLLM's OpenAI server, ...), and optionally the same requests through
our engine in-process, to see what the serving path costs.

Closed loop: `--num-requests` streaming `/v1/completions` requests, `--concurrency` in
flight, a new one sent as soon as one ends; greedy, EOS ignored, so every request
produces exactly its `max_tokens`. Two length mixes: `uniform` (every request
`--output-len` tokens) and `longtail` (lognormal, clipped to [--min-len, --max-len]:
a few long requests among many short ones, as real traffic is). The prompts and lengths
are seeded, so two servers get the same requests.

The HTTP half is a client (no torch); `--engine MODEL` imports the engine."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx

from triptych.bench.errors import BenchError
from triptych.bench.workload import make_prompt

WORKLOADS = ("uniform", "longtail")
LONGTAIL_SIGMA = 1.0  # lognormal sigma of the long-tailed lengths (median at the range's geometric mean)


@dataclass(frozen=True)
class TextLoad:
    kind: str = "uniform"
    num_requests: int = 64
    output_len: int = 128  # uniform: every request's tokens
    min_len: int = 8  # longtail: clip range
    max_len: int = 512
    prompt_words: int = 24
    seed: int = 0

    def lengths(self) -> list[int]:
        """Each request's max_tokens."""
        if self.kind == "uniform":
            return [self.output_len] * self.num_requests
        if self.kind != "longtail":
            raise BenchError(f"unknown workload {self.kind!r} (one of {', '.join(WORKLOADS)})")
        rng = random.Random(self.seed + 1)
        mu = math.log(math.sqrt(self.min_len * self.max_len))
        return [min(self.max_len, max(self.min_len, round(rng.lognormvariate(mu, LONGTAIL_SIGMA))))
                for _ in range(self.num_requests)]

    def prompts(self) -> list[str]:
        rng = random.Random(self.seed)
        return [make_prompt(rng, self.prompt_words) for _ in range(self.num_requests)]


@dataclass
class RunResult:
    wall_s: float
    tokens: int
    errors: list[str]
    ttft_s: list[float]

    def summary(self) -> dict[str, Any]:
        ttft = sorted(t for t in self.ttft_s if t > 0)  # unstreamed requests have none
        return {"wall_s": round(self.wall_s, 3), "output_tokens": self.tokens,
                "output_tokens_per_s": round(self.tokens / self.wall_s, 1) if self.wall_s else 0.0,
                "ttft_p50_ms": round(1000 * ttft[len(ttft) // 2], 1) if ttft else None,
                "errors": len(self.errors), "first_error": self.errors[0] if self.errors else None}


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
               headers: dict[str, str]) -> tuple[int, float, str | None]:
    """(completion tokens, TTFT, error) of one streaming completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft = 0.0
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            return 0, 0.0, f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                return tokens, ttft, f"stream error: {obj['error']}"
            if not ttft and any(c.get("text") for c in obj.get("choices") or []):
                ttft = time.perf_counter() - start
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
    if tokens != max_tokens:
        return tokens, ttft, f"got {tokens} tokens, asked for {max_tokens}"
    return tokens, ttft, None


async def _one_whole(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                     headers: dict[str, str]) -> tuple[int, float, str | None]:
    """Like `_one`, unstreamed: the answer whole, so its TTFT is unknown (0)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    resp = await client.post(f"{url}/v1/completions", json=body, headers=headers)
    if resp.status_code != 200:
        return 0, 0.0, f"HTTP {resp.status_code}: {resp.content[:200]!r}"
    tokens = resp.json()["usage"]["completion_tokens"]
    if tokens != max_tokens:
        return tokens, 0.0, f"got {tokens} tokens, asked for {max_tokens}"
    return tokens, 0.0, None


async def run_http(url: str, load: TextLoad, concurrency: int, headers: dict[str, str],
                   timeout_s: float = 600.0, stream: bool = True) -> RunResult:
    """One closed-loop run against `url`."""
    url = url.rstrip("/")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits, trust_env=False) as client:
        resp = await client.get(f"{url}/v1/models", headers=headers)
        resp.raise_for_status()
        model = resp.json()["data"][0]["id"]
        one = _one if stream else _one_whole
        await one(client, url, model, "warm up", 4, headers)  # connections, first-call costs
        work = list(zip(load.prompts(), load.lengths(), strict=True))
        errors: list[str] = []
        ttfts: list[float] = []
        total = 0

        async def worker() -> None:
            nonlocal total
            while work:
                prompt, n = work.pop(0)
                try:
                    got, ttft, err = await one(client, url, model, prompt, n, headers)
                except httpx.HTTPError as exc:
                    got, ttft, err = 0, 0.0, f"{type(exc).__name__}: {exc}"
                total += got
                ttfts.append(ttft)
                if err:
                    errors.append(err)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return RunResult(time.perf_counter() - start, total, errors, ttfts)


class InProcess:
    """The same requests through our engine's `step` loop, closed loop, prompts tokenized
    as the router tokenizes a completion's prompt (no detokenization: the engine's figure)."""

    def __init__(self, model_dir: str, concurrency: int) -> None:
        from triptych.processor import MultimodalProcessor
        from triptych.worker.engine import Engine, EngineConfig

        self.proc = MultimodalProcessor.from_pretrained(model_dir)
        self.engine = Engine(EngineConfig(model=model_dir, max_num_seqs=concurrency, detokenize=False))
        self.concurrency = concurrency

    def run(self, load: TextLoad) -> RunResult:
        from triptych.sampling_params import SamplingParams
        from triptych.worker.engine import Request

        work = list(zip(load.prompts(), load.lengths(), strict=True))
        live: dict[str, Request] = {}
        done: list[Request] = []
        start = time.perf_counter()
        i = 0
        while work or live:
            while work and len(live) < self.concurrency:
                prompt, n = work.pop(0)
                params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                req = Request(f"r{i}", self.proc.encode(prompt), params)
                req.timings.arrival = time.monotonic()
                i += 1
                self.engine.add_request(req)
                live[req.request_id] = req
            for out in self.engine.step():
                if out.finished:
                    done.append(live.pop(out.request_id))
        wall = time.perf_counter() - start
        errors = [r.error for r in done if r.error]
        ttft = [r.timings.first_token - r.timings.arrival for r in done
                if r.timings.first_token is not None and r.timings.arrival is not None]
        return RunResult(wall, sum(len(r.output_token_ids) for r in done), errors, ttft)


def _load_avg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def cli_main(args: argparse.Namespace) -> int:
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, flush=True))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    kinds = WORKLOADS if args.workload == "both" else (args.workload,)
    if not args.url and not args.engine:
        print("error: give --url (a server) and/or --engine MODEL (in-process)", file=sys.stderr)
        return 2
    engine = InProcess(args.engine, args.concurrency) if args.engine else None
    if engine is not None:  # first steps pay for allocation and first-call costs
        engine.run(TextLoad(kind="uniform", num_requests=2, output_len=4))
    report: dict[str, Any] = {"url": args.url, "concurrency": args.concurrency, "workloads": {}}
    for kind in kinds:
        load = TextLoad(kind=kind, num_requests=args.num_requests, output_len=args.output_len,
                        min_len=args.min_len, max_len=args.max_len, seed=args.seed)
        lens = load.lengths()
        say(f"{kind}: {len(lens)} completions, {args.concurrency} concurrent, {sum(lens)} tokens "
            f"(lengths {min(lens)}-{max(lens)}, median {sorted(lens)[len(lens) // 2]})")
        runs: dict[str, list[dict[str, Any]]] = {"http": [], "engine": []}
        # In turns (A B A B): both see the same neighbours' load on a shared machine.
        for _ in range(args.repeats):
            if args.url:
                try:
                    r = asyncio.run(run_http(args.url, load, args.concurrency, headers, args.request_timeout,
                                             stream=not args.no_stream))
                except httpx.HTTPError as exc:
                    print(f"error: {args.url}: {exc}", file=sys.stderr)
                    return 2
                runs["http"].append({**r.summary(), "loadavg": _load_avg()})
                say(f"  http   {r.summary()['output_tokens_per_s']:8.1f} tok/s  {r.summary()}")
            if engine is not None:
                r = engine.run(load)
                runs["engine"].append({**r.summary(), "loadavg": _load_avg()})
                say(f"  engine {r.summary()['output_tokens_per_s']:8.1f} tok/s  {r.summary()}")
        best = {k: max(v, key=lambda s: s["output_tokens_per_s"]) for k, v in runs.items() if v}
        entry: dict[str, Any] = {"tokens": sum(lens), "runs": runs, "best": best}
        if "http" in best and "engine" in best:
            entry["http_over_engine"] = round(best["http"]["output_tokens_per_s"]
                                              / best["engine"]["output_tokens_per_s"], 3)
            say(f"  best: http {best['http']['output_tokens_per_s']} tok/s, engine "
                f"{best['engine']['output_tokens_per_s']} tok/s -> http/engine {entry['http_over_engine']}")
        report["workloads"][kind] = entry
    if args.json:
        print(json.dumps(report, indent=2))
    failed = any(s["errors"] for e in report["workloads"].values() for v in e["runs"].values() for s in v)
    return 1 if failed else 0

