"""`triptych bench engine`: our engine against transformers on CPU, same requests.

Multimodal set (one image + a prompt per request), closed loop at each concurrency c
(2c requests, a new one submitted as soon as one finishes):
- ours: continuous batching, every decode of the batch in one forward, chunked prefill;
- transformers `generate()`: static batches of c (left padded), the usual way to batch it.
Both fp32, SDPA attention, the same torch thread count, EOS ignored so every request
produces exactly `--output-len` tokens. TTFT counts from submission (preprocessing
included on both sides); TPOT is a request's (last token - first token) / (n - 1).

Text-only set: ours against transformers' continuous batching `generate_batch` (when the
installed version has it; its scheduler does not take M-RoPE models, so it runs the
checkpoint's language model as a plain `*ForCausalLM` with the same weights, which
computes the same thing for text), all requests submitted at once, c at a time.

Each figure is the best of REPEATS runs (by wall-clock throughput), the two systems' runs
taken in turns. Next to wall-clock
tokens/s the table shows tokens per CPU-second of this process: on a machine shared with
other work, wall-clock figures move with the neighbours' load; CPU time much less.

Text workloads (the issue's reference setup: the checkpoint's language model on text,
`--workload-requests` requests, `--workload-concurrency` in flight), ours closed loop
against transformers `generate()` in static batches (left padded) of the text LM:
- uniform: every request `--uniform-len` tokens, all there at t0 (`speedup_vs_transformers`);
- long-tailed: output lengths lognormal (median `--longtail-median`, sigma
  `--longtail-sigma`) clipped to `--longtail-range`, requests arriving over time as a
  Poisson process of `--arrival-rate` per second (`speedup_vs_transformers_realistic`).
  A static batch takes whatever has arrived (up to c) and runs to its longest request:
  the shorter ones' slots idle, as they do in `generate()`.
Alongside, the fraction of this machine's matmul peak that our decode and prefill steps
reach: the peak is a large GEMM in the model's dtype timed in the same run, a step's
FLOPs are those of its linear layers and attention products.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from triptych.sampling_params import SamplingParams

REPEATS = 2
PROMPTS = [
    "Describe this image.",
    "What is in the picture? Answer in one sentence.",
    "List the colours you can see, from the most to the least common.",
    "Is there a person in this photo? If so, what are they doing and where are they?",
    "Write a short caption for the image.",
    "How many objects are visible, and which one is the largest?",
]
# Assorted sizes, as real uploads are: 64, 16, 48, 32 and 25 visual tokens for Qwen2-VL small.
IMAGE_SIZES = [(224, 224), (112, 112), (168, 224), (224, 112), (140, 140)]


@dataclass
class RunResult:
    wall_s: float
    output_tokens: int
    cpu_s: float = 0.0  # process CPU time: robust to other load on a shared machine
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    steps: dict[str, Any] = field(default_factory=dict)  # ours: decode / prefill step FLOP rates

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.output_tokens / self.cpu_s if self.cpu_s else 0.0

    def summary(self) -> dict[str, Any]:
        return {"wall_s": round(self.wall_s, 3), "cpu_s": round(self.cpu_s, 3), "output_tokens": self.output_tokens,
                "output_tokens_per_s": round(self.tokens_per_s, 2),
                "output_tokens_per_cpu_s": round(self.tokens_per_cpu_s, 2),
                "ttft_ms": _percentiles(self.ttft_s), "tpot_ms": _percentiles(self.tpot_s),
                **({"steps": self.steps} if self.steps else {})}


def _percentiles(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "mean": round(1000 * statistics.mean(values), 2)}


def _timed(run: Callable[[], RunResult]) -> RunResult:
    cpu = time.process_time()
    result = run()
    result.cpu_s = time.process_time() - cpu
    return result


def best_of_interleaved(runs: Sequence[Callable[[], RunResult]], repeats: int = REPEATS) -> list[RunResult]:
    """Best run of each contender, their runs taken in turns (A B A B) so that both see the
    same background load."""
    results: list[list[RunResult]] = [[] for _ in runs]
    for _ in range(repeats):
        for mine, run in zip(results, runs, strict=True):
            mine.append(_timed(run))
    return [max(rs, key=lambda r: r.tokens_per_s) for rs in results]


@dataclass
class Case:
    messages: list[dict[str, Any]]
    images: list[Any]


def multimodal_cases(n: int, seed: int = 0) -> list[Case]:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    cases = []
    for i in range(n):
        w, h = IMAGE_SIZES[i % len(IMAGE_SIZES)]
        img = Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8), mode="RGB")
        content = [{"type": "image"}, {"type": "text", "text": PROMPTS[i % len(PROMPTS)]}]
        cases.append(Case([{"role": "user", "content": content}], [img]))
    return cases


def text_cases(n: int) -> list[Case]:
    return [Case([{"role": "user", "content": [{"type": "text", "text": " ".join([PROMPTS[i % len(PROMPTS)]] * (1 + i % 3))}]}],
                 []) for i in range(n)]


@dataclass
class TextJob:
    case: Case
    output_len: int
    arrival_s: float = 0.0  # after the run's start


def uniform_jobs(n: int, output_len: int) -> list[TextJob]:
    return [TextJob(c, output_len) for c in text_cases(n)]


def longtail_jobs(n: int, lo: int, hi: int, median: float, sigma: float, rate: float,
                  seed: int = 0) -> list[TextJob]:
    """Lognormal output lengths clipped to [lo, hi]; Poisson arrivals at `rate` per second
    (the first at t0), as chat traffic has: most answers short, a few very long."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lens = np.clip(np.rint(rng.lognormal(np.log(median), sigma, n)), lo, hi).astype(int)
    gaps = rng.exponential(1.0 / rate, n) if rate > 0 else np.zeros(n)
    arrivals = np.cumsum(gaps) - gaps[0]
    return [TextJob(c, int(n_out), float(t)) for c, n_out, t in zip(text_cases(n), lens, arrivals, strict=True)]


# --- matmul peak and step FLOPs ---------------------------------------------------------------

def matmul_peak_flops(dtype: torch.dtype, n: int = 1024, repeats: int = 10) -> float:
    """FLOP/s of one large square GEMM in `dtype` (best of `repeats`) on the current threads,
    with the faster of the kernels the engine may use (torch.mm, and on CPU oneDNN over a
    reordered weight: worker/models/linear_kernels.py): what this machine's matmul units
    give right now."""
    from triptych.worker.models.linear_kernels import linear_kernel

    a = torch.randn(n, n).to(dtype)
    weight = torch.nn.Linear(n, n, bias=False, dtype=dtype).requires_grad_(False)
    kernels = [lambda: torch.mm(a, weight.weight), lambda k=linear_kernel(weight): k(a)]
    best = float("inf")
    for kernel in kernels:
        kernel()  # warm up (packing, thread pool)
        for _ in range(repeats):
            t0 = time.perf_counter()
            kernel()
            best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


class StepMeter:
    """Times the engine's language-model steps (`ModelRunner.run_language`) and counts their
    FLOPs: 2 per weight of every linear layer per token, 2 per LM-head weight per sampled
    row, and 4 * heads * head_dim per (query, key) pair of attention (QK^T and PV).
    Decode-only steps and steps holding a prefill chunk are kept apart."""

    def __init__(self, engine: Any) -> None:
        runner = engine.runner
        lm = runner.language
        self.per_token = 2 * sum(m.weight.numel() for m in lm.layers.modules() if isinstance(m, torch.nn.Linear))
        self.per_sample = 2 * lm.lm_head.weight.numel()
        self.per_pair = 4 * lm.spec.num_heads * lm.spec.head_dim * lm.spec.num_layers
        self._runner, self._inner = runner, runner.run_language
        self.totals = {"decode": [0, 0.0, 0], "prefill": [0, 0.0, 0]}  # flops, seconds, steps
        runner.run_language = self._timed

    def _timed(self, chunks: list[Any]) -> Any:
        t0 = time.perf_counter()
        sampled = self._inner(chunks)
        elapsed = time.perf_counter() - t0
        flops = 0
        for c in chunks:
            # Query j of the chunk sees c.start + j + 1 keys.
            pairs = c.num_tokens * c.start + c.num_tokens * (c.num_tokens + 1) // 2
            flops += self.per_token * c.num_tokens + self.per_pair * pairs + (self.per_sample if c.samples else 0)
        kind = "decode" if all(c.num_tokens == 1 for c in chunks) else "prefill"
        t = self.totals[kind]
        t[0], t[1], t[2] = t[0] + flops, t[1] + elapsed, t[2] + 1
        return sampled

    def close(self) -> None:
        self._runner.run_language = self._inner

    def report(self, peak: float) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for kind, (flops, secs, n) in self.totals.items():
            if n and secs > 0:
                rate = flops / secs
                out[kind] = {"steps": n, "ms_per_step": round(1000 * secs / n, 3), "gflops": round(rate / 1e9, 2),
                             "fraction_of_peak": round(rate / peak, 4)}
        return out


# --- ours ---------------------------------------------------------------------------------

class Ours:
    def __init__(self, model_dir: Path, dtype: str = "float32", compile_decode: bool = False) -> None:
        from triptych.processor import MultimodalProcessor

        self.model_dir = model_dir
        self.dtype = dtype
        self.compile_decode = compile_decode
        self.peak_flops = 0.0  # set by the command: the GEMM peak StepMeter reports against
        self.proc = MultimodalProcessor.from_pretrained(model_dir)
        self._engines: dict[int, Any] = {}

    def engine(self, concurrency: int) -> Any:
        from triptych.worker.engine import Engine, EngineConfig

        if concurrency not in self._engines:
            self._engines = {concurrency: Engine(EngineConfig(model=str(self.model_dir), max_num_seqs=concurrency,
                                                              detokenize=False, dtype=self.dtype,
                                                              compile_decode=self.compile_decode))}
        return self._engines[concurrency]

    def closed_loop(self, cases: list[Case], concurrency: int, output_len: int) -> RunResult:
        """Keep `concurrency` requests in flight; each is processed when submitted."""
        from triptych.worker.engine import Request

        engine = self.engine(concurrency)
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        queue = deque(enumerate(cases))
        live: dict[str, Any] = {}
        done: list[Any] = []
        start = time.monotonic()
        while queue or live:
            while queue and len(live) < concurrency:
                i, case = queue.popleft()
                arrival = time.monotonic()
                p = self.proc.process(case.messages, case.images)
                req = Request(f"r{i}", p.token_ids, params, mm_items=p.mm_items,
                              images={it.content_hash: im.image for it, im in zip(p.mm_items, p.images, strict=True)})
                req.timings.arrival = arrival
                engine.add_request(req)
                live[req.request_id] = req
            for out in engine.step():
                if out.finished:
                    done.append(live.pop(out.request_id))
        return _result(time.monotonic() - start, done)

    def all_at_once(self, cases: list[Case], concurrency: int, output_len: int) -> RunResult:
        """Every request submitted at t0 (as generate_batch gets them), `concurrency` at a time."""
        from triptych.worker.engine import Request

        engine = self.engine(concurrency)
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        start = time.monotonic()
        reqs = [Request(f"t{i}", self.proc.process(c.messages).token_ids, params) for i, c in enumerate(cases)]
        for r in reqs:
            r.timings.arrival = start
        engine.generate_batch(reqs)
        return _result(time.monotonic() - start, reqs)


    def text_jobs(self, jobs: list[TextJob], concurrency: int) -> RunResult:
        """Closed loop over arriving requests: a request is taken in once it has arrived and
        fewer than `concurrency` are in flight; each has its own output length."""
        from triptych.worker.engine import Request

        engine = self.engine(concurrency)
        meter = StepMeter(engine)
        queue = deque(enumerate(jobs))
        live: dict[str, Any] = {}
        done: list[Any] = []
        start = time.monotonic()
        try:
            while queue or live:
                now = time.monotonic()
                while queue and len(live) < concurrency and start + queue[0][1].arrival_s <= now:
                    i, job = queue.popleft()
                    params = SamplingParams(temperature=0.0, max_tokens=job.output_len, ignore_eos=True)
                    req = Request(f"x{i}", self.proc.process(job.case.messages).token_ids, params)
                    req.timings.arrival = start + job.arrival_s
                    engine.add_request(req)
                    live[req.request_id] = req
                if not live:  # idle until the next arrival
                    time.sleep(max(0.0, start + queue[0][1].arrival_s - time.monotonic()))
                    continue
                for out in engine.step():
                    if out.finished:
                        done.append(live.pop(out.request_id))
        finally:
            meter.close()
        result = _result(time.monotonic() - start, done)
        result.steps = meter.report(self.peak_flops) if self.peak_flops else {}
        return result


def _result(wall: float, reqs: list[Any]) -> RunResult:
    bad = [r.error for r in reqs if r.error]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed: {bad[0]}")
    result = RunResult(wall, sum(len(r.output_token_ids) for r in reqs))
    for r in sorted(reqs, key=lambda r: int(r.request_id[1:])):
        t = r.timings
        result.ttft_s.append(t.first_token - t.arrival)
        if len(t.token_times) > 1:
            result.tpot_s.append((t.token_times[-1] - t.token_times[0]) / (len(t.token_times) - 1))
        result.outputs.append(list(r.output_token_ids))
    return result


# --- transformers -------------------------------------------------------------------------

_MODEL_CLASSES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                  "llava": "LlavaForConditionalGeneration"}


def _model_type(model_dir: Path) -> str:
    return json.loads((model_dir / "config.json").read_text())["model_type"]


def hf_model(model_dir: Path, dtype: torch.dtype = torch.float32) -> Any:
    import transformers

    cls = getattr(transformers, _MODEL_CLASSES[_model_type(model_dir)])
    return cls.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="sdpa").eval()


def hf_text_model(vl_model: Any) -> Any:
    """The VL checkpoint's language model as a plain causal LM with the same weights. For
    text-only input Qwen's M-RoPE positions are equal on all axes, i.e. plain RoPE."""
    import transformers

    cfg = {k: v for k, v in vl_model.config.text_config.to_dict().items()
           if k not in ("model_type", "architectures", "transformers_version")}
    if vl_model.config.model_type == "llava":
        config = transformers.AutoConfig.for_model(vl_model.config.text_config.model_type, **cfg)
    else:
        cfg.get("rope_parameters", {}).pop("mrope_section", None)
        config = transformers.Qwen2Config(**cfg)
    config._attn_implementation = "sdpa"
    lm = transformers.AutoModelForCausalLM.from_config(config, dtype=vl_model.dtype).eval()
    state = {f"model.{k}": v for k, v in vl_model.model.language_model.state_dict().items()}
    state["lm_head.weight"] = vl_model.lm_head.weight
    lm.load_state_dict(state, strict=True)
    return lm


def hf_processor(model_dir: Path) -> Any:
    """The family's HF processor. Qwen's needs torchvision for its video half, which cannot
    be installed next to our torch; the image half is built without it."""
    import transformers

    model_type = _model_type(model_dir)
    if model_type == "llava":
        proc = transformers.AutoProcessor.from_pretrained(str(model_dir))
    else:
        cls = transformers.Qwen2VLProcessor if model_type == "qwen2_vl" else transformers.Qwen2_5_VLProcessor

        class ImageOnly(cls):  # type: ignore[misc, valid-type]
            def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None,
                         **kwargs: Any) -> None:
                super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

        proc = ImageOnly(image_processor=transformers.AutoImageProcessor.from_pretrained(str(model_dir)),
                         tokenizer=transformers.AutoTokenizer.from_pretrained(str(model_dir)),
                         chat_template=(model_dir / "chat_template.jinja").read_text())
    proc.tokenizer.padding_side = "left"
    return proc


class _StepClock:
    """A logits processor that only timestamps each generation step of the batch."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.monotonic())
        return scores


class Transformers:
    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.float32) -> None:
        self.model = hf_model(model_dir, dtype)
        self.proc = hf_processor(model_dir)
        tok = self.proc.tokenizer
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self._text_model: Any = None

    def static_batches(self, cases: list[Case], concurrency: int, output_len: int) -> RunResult:
        from transformers import LogitsProcessorList

        result = RunResult(0.0, 0)
        start = time.monotonic()
        for i in range(0, len(cases), concurrency):
            batch = cases[i:i + concurrency]
            arrival = time.monotonic()
            texts = [self.proc.apply_chat_template(c.messages, tokenize=False, add_generation_prompt=True)
                     for c in batch]
            images = [img for c in batch for img in c.images] or None
            inputs = self.proc(text=texts, images=images, padding=True, return_tensors="pt")
            clock = _StepClock()
            with torch.inference_mode():
                out = self.model.generate(**inputs, max_new_tokens=output_len, min_new_tokens=output_len,
                                          do_sample=False, num_beams=1, pad_token_id=self.pad,
                                          logits_processor=LogitsProcessorList([clock]))
            new = out[:, inputs["input_ids"].shape[1]:]
            assert new.shape[1] == output_len
            times = clock.times
            for row in new.tolist():
                result.ttft_s.append(times[0] - arrival)
                result.tpot_s.append((times[-1] - times[0]) / (len(times) - 1))
                result.outputs.append(row)
            result.output_tokens += len(batch) * output_len
        result.wall_s = time.monotonic() - start
        return result

    @property
    def text_model(self) -> Any:
        if self._text_model is None:
            self._text_model = hf_text_model(self.model)
        return self._text_model

    def static_text(self, jobs: list[TextJob], concurrency: int) -> RunResult:
        """`generate()` on the text LM in static batches: when the model is free, whatever has
        arrived (up to `concurrency`) is one left-padded batch, run to its longest request."""
        from transformers import LogitsProcessorList

        tok = self.proc.tokenizer
        result = RunResult(0.0, 0)
        queue = deque(jobs)
        start = time.monotonic()
        while queue:
            time.sleep(max(0.0, start + queue[0].arrival_s - time.monotonic()))
            now = time.monotonic()
            batch: list[TextJob] = []
            while queue and len(batch) < concurrency and start + queue[0].arrival_s <= now:
                batch.append(queue.popleft())
            ids = [tok.apply_chat_template(j.case.messages, tokenize=True, add_generation_prompt=True) for j in batch]
            ids = [list(x["input_ids"]) if hasattr(x, "keys") else list(x) for x in ids]
            inputs = tok.pad({"input_ids": ids}, padding=True, return_tensors="pt")
            longest = max(j.output_len for j in batch)
            clock = _StepClock()
            with torch.inference_mode():
                out = self.text_model.generate(**inputs, max_new_tokens=longest, min_new_tokens=longest,
                                               do_sample=False, num_beams=1, pad_token_id=self.pad,
                                               logits_processor=LogitsProcessorList([clock]))
            new = out[:, inputs["input_ids"].shape[1]:].tolist()
            times = clock.times
            for job, row in zip(batch, new, strict=True):
                n = job.output_len
                result.ttft_s.append(times[0] - (start + job.arrival_s))
                if n > 1:
                    result.tpot_s.append((times[n - 1] - times[0]) / (n - 1))
                result.outputs.append(row[:n])
                result.output_tokens += n
        result.wall_s = time.monotonic() - start
        return result

    @property
    def has_continuous_batching(self) -> bool:
        return callable(getattr(self.model, "generate_batch", None))

    def continuous(self, cases: list[Case], concurrency: int, output_len: int) -> RunResult:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        ids = [self.proc.tokenizer.apply_chat_template(c.messages, tokenize=True, add_generation_prompt=True)
               for c in cases]
        ids = [list(x["input_ids"]) if hasattr(x, "keys") else list(x) for x in ids]
        longest = max(len(x) for x in ids) + output_len
        gen = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=-1)
        cb = ContinuousBatchingConfig(max_requests_per_batch=concurrency, page_size=16,
                                      num_blocks=concurrency * (longest // 16 + 2), max_batch_tokens=2048)
        start = time.perf_counter()  # transformers stamps tokens with perf_counter
        # No inference_mode here: its worker thread resets tensors created under it.
        outs = self.text_model.generate_batch(inputs=ids, generation_config=gen, continuous_batching_config=cb,
                                               record_timestamps=True, progress_bar=False)
        result = RunResult(time.perf_counter() - start, 0)
        failed = [o.error for o in outs.values() if o.error or len(o.generated_tokens) != output_len]
        if failed or len(outs) != len(ids):
            raise RuntimeError(f"generate_batch: {len(failed)} of {len(ids)} requests failed: {failed[:1]}")
        for o in sorted(outs.values(), key=lambda o: int(o.request_id.rsplit("_", 1)[-1])):
            result.output_tokens += len(o.generated_tokens)
            stamps = list(o.timestamps or [])
            if stamps:
                result.ttft_s.append(stamps[0] - start)
            if len(stamps) > 1:
                result.tpot_s.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
            result.outputs.append(list(o.generated_tokens))
        return result


# --- the command --------------------------------------------------------------------------

HEADER = (f"  {'system':<30} {'tokens':>6} {'tok/s':>8} {'tok/cpu-s':>9}   {'TTFT p50':>8} {'p90':>8} {'p99':>8}   "
          f"{'TPOT p50':>8} {'p90':>7} {'p99':>7}   (ms)")


def _row(name: str, r: RunResult) -> str:
    s = r.summary()
    t, p = s["ttft_ms"], s["tpot_ms"]
    return (f"  {name:<30} {r.output_tokens:>6} {s['output_tokens_per_s']:>8.1f} {s['output_tokens_per_cpu_s']:>9.1f}   "
            f"{t.get('p50', 0):>8.1f} {t.get('p90', 0):>8.1f} {t.get('p99', 0):>8.1f}   "
            f"{p.get('p50', 0):>8.1f} {p.get('p90', 0):>7.1f} {p.get('p99', 0):>7.1f}")


def _same(a: RunResult, b: RunResult) -> int:
    return sum(x == y for x, y in zip(a.outputs, b.outputs, strict=True))


def compare(say: Callable[..., None], title: str, n: int, ours: RunResult, theirs: RunResult,
            their_name: str) -> dict[str, Any]:
    ratio = ours.tokens_per_s / theirs.tokens_per_s
    cpu_ratio = ours.tokens_per_cpu_s / theirs.tokens_per_cpu_s if theirs.tokens_per_cpu_s else 0.0
    same = _same(ours, theirs)
    say(f"{title} ({n} requests)\n{HEADER}\n{_row('triptych', ours)}\n{_row(their_name, theirs)}\n"
        f"  -> throughput ratio {ratio:.2f}x (per CPU-second {cpu_ratio:.2f}x); "
        f"identical token ids in {same}/{n} requests")
    return {"requests": n, "triptych": ours.summary(), their_name: theirs.summary(), "speedup": round(ratio, 3),
            "speedup_cpu_time": round(cpu_ratio, 3), "identical_outputs": same}


def _workload_jobs(args: argparse.Namespace) -> dict[str, list[TextJob]]:
    n = args.workload_requests
    lo, hi = args.longtail_range
    return {"uniform": uniform_jobs(n, args.uniform_len),
            "longtail": longtail_jobs(n, lo, hi, args.longtail_median, args.longtail_sigma, args.arrival_rate)}


def run_workloads(say: Callable[..., None], args: argparse.Namespace, ours: Ours, theirs: Transformers,
                  peak: float) -> dict[str, Any]:
    """The text workloads at `--workload-concurrency`: ours (closed loop over arrivals)
    against transformers generate() in static batches of the text LM."""
    c = args.workload_concurrency
    out: dict[str, Any] = {"concurrency": c}
    for name, jobs in _workload_jobs(args).items():
        if name not in args.workloads:
            continue
        lens = sorted(j.output_len for j in jobs)
        title = (f"{name}: {len(jobs)} text requests, {c} in flight, output lengths {lens[0]}-{lens[-1]} "
                 f"(median {lens[len(lens) // 2]}), arrivals over {jobs[-1].arrival_s:.1f} s")
        mine, base = best_of_interleaved([lambda: ours.text_jobs(jobs, c),  # noqa: B023
                                          lambda: theirs.static_text(jobs, c)])  # noqa: B023
        out[name] = compare(say, title, len(jobs), mine, base, "transformers generate()")
        out[name]["output_lens"] = {"min": lens[0], "median": lens[len(lens) // 2], "max": lens[-1],
                                    "total": sum(lens)}
        for kind, st in mine.steps.items():
            say(f"  our {kind} steps: {st['steps']} x {st['ms_per_step']:.1f} ms, {st['gflops']:.1f} GFLOP/s = "
                f"{100 * st['fraction_of_peak']:.1f}% of the GEMM peak ({peak / 1e9:.1f} GFLOP/s)")
    return out


def cli_main(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model:
        model_dir = Path(args.model)
    else:
        from triptych.tiny_model import tiny_model_path

        model_dir = tiny_model_path("qwen2-vl", size="small")
    threads = torch.get_num_threads()
    say: Callable[..., None] = (lambda *a: None) if args.json else (lambda *a: print(*a, flush=True))
    out_len = args.output_len
    from triptych.worker.engine.config import _DTYPES

    dtype = _DTYPES[args.dtype]
    sections = set(args.sections)
    peak = matmul_peak_flops(dtype)
    say(f"model {model_dir} | {args.dtype}, SDPA, CPU, torch threads {threads} | EOS ignored | "
        f"best of {REPEATS} runs, taken in turns | GEMM peak {peak / 1e9:.1f} GFLOP/s ({args.dtype}, 1024^3 GEMM)")
    report: dict[str, Any] = {"model": str(model_dir), "threads": threads, "output_len": out_len, "dtype": args.dtype,
                              "compile_decode": args.compile_decode, "repeats": REPEATS,
                              "matmul_peak_gflops": round(peak / 1e9, 2), "multimodal": {}, "text_only": {}}
    ours, theirs = Ours(model_dir, args.dtype, args.compile_decode), Transformers(model_dir, dtype)
    ours.peak_flops = peak
    warm = multimodal_cases(2, seed=99)
    ours.closed_loop(warm, 1, 2)
    theirs.static_batches(warm, 1, 2)

    if "workloads" in sections:
        say("\ntext workloads (the checkpoint's language model): ours closed loop; transformers generate() "
            "in static batches of whatever has arrived")
        report["workloads"] = work = run_workloads(say, args, ours, theirs, peak)
        if "uniform" in work:
            report["speedup_vs_transformers"] = work["uniform"]["speedup"]
            report["speedup_vs_transformers_cpu_time"] = work["uniform"]["speedup_cpu_time"]
        if "longtail" in work:
            report["speedup_vs_transformers_realistic"] = work["longtail"]["speedup"]
            report["speedup_vs_transformers_realistic_cpu_time"] = work["longtail"]["speedup_cpu_time"]
        report["speedup_concurrency"] = work["concurrency"]

    if "multimodal" in sections:
        say(f"\nmultimodal: 1 image + prompt per request, {out_len} tokens each, closed loop; "
            f"transformers generate() in static batches of c")
        for c in args.concurrency:
            cases = multimodal_cases(max(2 * c, 4), seed=c)
            mine, base = best_of_interleaved([lambda: ours.closed_loop(cases, c, out_len),  # noqa: B023
                                              lambda: theirs.static_batches(cases, c, out_len)])  # noqa: B023
            report["multimodal"][str(c)] = compare(say, f"concurrency {c}", len(cases), mine, base,
                                                   "transformers generate()")
        key = "32" if "32" in report["multimodal"] else str(max(args.concurrency))
        report["speedup_vs_transformers_multimodal"] = report["multimodal"][key]["speedup"]
        report["speedup_multimodal_concurrency"] = int(key)

    if "text_only" in sections:
        say(f"\ntext-only, all requests submitted at once, {out_len} tokens each: "
            f"transformers continuous batching generate_batch()")
        if not theirs.has_continuous_batching:
            report["text_only"] = {"unavailable": "this transformers version has no generate_batch"}
            say("  unavailable: this transformers version has no model.generate_batch")
        else:
            for c in args.concurrency:
                cases = text_cases(max(2 * c, 4))
                try:
                    mine, base = best_of_interleaved([lambda: ours.all_at_once(cases, c, out_len),  # noqa: B023
                                                      lambda: theirs.continuous(cases, c, out_len)])  # noqa: B023
                except Exception as exc:  # report, don't hide: its CPU path is young
                    report["text_only"][str(c)] = {"error": repr(exc)}
                    say(f"concurrency {c}: transformers generate_batch failed: {exc!r}")
                    continue
                report["text_only"][str(c)] = compare(say, f"concurrency {c}", len(cases), mine, base,
                                                      "transformers generate_batch()")

    if args.json:
        print(json.dumps(report))
    else:
        for key, what in (("speedup_vs_transformers", "uniform"), ("speedup_vs_transformers_realistic", "long-tailed"),
                          ("speedup_vs_transformers_multimodal", "multimodal")):
            if key in report:
                print(f"\n{what} throughput vs transformers generate(): {report[key]:.2f}x wall-clock")
    return 0
