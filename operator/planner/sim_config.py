"""The simulator's configuration and its report (operator/planner/simulator.py): what a
run is asked to model, and what it tells, as `triptych bench serve` reports a measured run."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class SimConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ttft_slo_s: float = Field(2.0, gt=0)
    tbt_slo_s: float = Field(0.2, gt=0)
    routing: Literal["round-robin", "least-loaded"] = "round-robin"
    parallel_encode: bool = True
    alpha: float = Field(0.5, gt=0, le=1)  # TriInfer Alg. 1: E/EP/P steps under alpha * TTFT SLO
    budget_image_pixels: int = Field(448 * 448, ge=1, description="image size the image budget is searched at")
    token_budget: int | None = Field(None, ge=1, description="fixed budget instead of the SLO-derived one")
    image_budget: int | None = Field(None, ge=1)
    instance_budgets: dict[str, tuple[int, int]] = Field(default_factory=dict, description="per instance type: "
                                                         "the (token, image) budgets its instances run with, over "
                                                         "the fixed and SLO-derived ones (a measured deployment's, "
                                                         "as its workers report them)")
    request_work_s: dict[str, float] = Field(default_factory=dict, description="per instance type: busy time "
                                             "an instance spends on each request it takes on besides its steps "
                                             "(the stage run's HTTP, decoding, transfers)")
    request_work_beside: bool = Field(True, description="request work is done when the request reaches "
                                      "the instance, before it joins a queue, on the CPU share the steps run on "
                                      "(a capped CPU instance: image decode and HTTP take CPU from the steps while "
                                      "both run); false: charged to the first step that schedules the request")
    ttft_overhead_s: float = Field(0.0, description="fixed time each request spends outside the "
                                   "instances before its first token (HTTP hops, SSE): added to TTFT and E2E; "
                                   "negative: request work (request_work_s) that the simulator charges "
                                   "before a request's first token and the served path does after it")
    ttft_noise_s: list[float] = Field(default_factory=list, description="measured spread of a lone "
                                      "request's TTFT around its median (seconds), the k-th request getting "
                                      "the (k mod n)-th: what the serving environment adds that the "
                                      "simulator's deterministic steps do not (a CPU quota's period phase, OS "
                                      "scheduling); empty: none")
    tpot_noise: list[float] = Field(default_factory=list, description="the same for TPOT, as factors on "
                                    "each request's simulated TPOT (1.0: its median)")

    def ttft_extra_s(self, rid: int) -> float:
        """What request `rid` spends before its first token beyond the instances' steps."""
        noise = self.ttft_noise_s[rid % len(self.ttft_noise_s)] if self.ttft_noise_s else 0.0
        return self.ttft_overhead_s + noise

    def tpot_factor(self, rid: int) -> float:
        return self.tpot_noise[rid % len(self.tpot_noise)] if self.tpot_noise else 1.0


class SimReport(BaseModel):
    topology: dict[str, int]
    rate: float
    num_requests: int
    completed: int
    slo_attainment: float
    ttft_p50_s: float | None = None
    ttft_p90_s: float | None = None
    ttft_p99_s: float | None = None
    tpot_p50_s: float | None = None
    tpot_p90_s: float | None = None
    tpot_p99_s: float | None = None
    e2e_p50_s: float | None = None
    e2e_p99_s: float | None = None
    throughput_rps: float = 0.0
    duration_s: float = 0.0
    utilization: dict[str, float] = Field(default_factory=dict, description="busy share per instance type")
    stopped_early: bool = False
    backlog_growth: int = Field(0, description="queued requests at the last arrival minus at half the trace")
    sustained: bool = Field(True, description="the queues did not grow over the trace (backlog_growth small)")
