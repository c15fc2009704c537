"""The operator's planner: a kopf daemon per MLLMDeployment with spec.autoscaling.enabled.

Every `spec.autoscaling.intervalSeconds` the daemon reads the resource afresh (the spec's
thresholds may change while it runs), takes a Snapshot from Prometheus
(`spec.autoscaling.prometheusUrl`, PromQL over httpx in a worker thread), lets the driver
decide, hands an action to the KubeConnector, and writes status.plan. The daemon stops
when autoscaling is switched off or the resource is deleted (kopf's `when` filter).
With TRIPTYCH_PLANNER_ENDPOINT=host:port the operator serves every daemon's
`triptych_planner_*` series (label deployment="namespace/name") on `/metrics` and their
PlanDocuments on `/plan`.

Replans need a step-time profile of the model on its GPUs. The operator does not hold the
checkpoint (it is on the workers' volume), so `spec.autoscaling.replanProfile` names a
ConfigMap with a measured profile or the model's config.json for a roofline
(k8s_profile.py); without it the reactive, encoder, decode and video rules run.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import kopf
from pydantic import RootModel, ValidationError

from triptych.kube import names
from triptych.kube.client import MLLM, KubeApiError
from triptych.operator.api import AutoscalingConfig, InvalidSpecError, ReplanProfileSource, parse_spec
from triptych.operator.context import OperatorContext
from triptych.operator.planner.driver import Driver, DriverConfig, PlanDocument, PlannerMetrics, Replanner
from triptych.operator.planner.endpoint import PlannerEndpoint
from triptych.operator.planner.k8s_connector import KubeConnector, TokenSource, read_admin_token
from triptych.operator.planner.k8s_profile import ProfileSourceError, load_replanner
from triptych.operator.planner.policy_types import Decision, History, PolicyConfig
from triptych.operator.planner.signals import PrometheusClient, Snapshot, snapshot_from_prometheus

log = logging.getLogger(__name__)
RESOURCE = (names.GROUP, names.VERSION, names.PLURAL)


def _endpoint_from_env() -> str | None:
    return os.environ.get("TRIPTYCH_PLANNER_ENDPOINT") or None


@dataclass
class PlannerSettings:
    """Operator-wide planner settings (tests shorten the PromQL window)."""

    promql_window: str = "2m"
    token_source: TokenSource = read_admin_token
    replanner: Replanner | None = None
    prometheus_timeout_s: float = 5.0
    # "host:port" serving every daemon's triptych_planner_* series and /plan (a map by
    # namespace/name); TRIPTYCH_PLANNER_ENDPOINT, off when unset
    endpoint: str | None = field(default_factory=_endpoint_from_env)
    metrics: PlannerMetrics = field(default_factory=PlannerMetrics)


PlanIndex = RootModel[dict[str, PlanDocument]]


SETTINGS = PlannerSettings()


def policy_config(auto: AutoscalingConfig, slo_tbt_s: float | None = None) -> PolicyConfig:
    """spec.autoscaling -> the policy's configuration, every field the CRD has; the decode
    rule measures TBT p90 against spec.slo.tbtMs."""
    return PolicyConfig.from_crd(
        auto, dry_run=auto.dry_run, encoder_scaling=auto.encoder_scaling, replan_gain=auto.replan_gain,
        sustain=auto.sustain, max_queue_per_instance=auto.max_queue_per_instance,
        divergence_on=auto.divergence_on, divergence_off=auto.divergence_off,
        encode_up=auto.encode_up, encode_down=auto.encode_down, decode_scaling=auto.decode_scaling,
        slo_tbt_s=slo_tbt_s, decode_up=auto.decode_up, decode_down=auto.decode_down,
        video_scaling=auto.video_scaling, video_up=auto.video_up, video_down=auto.video_down)


def seed_history(status: Mapping[str, Any] | None) -> History:
    """The last action recorded in status.plan, so cooldowns outlive an operator restart or
    a peering hand-over (the decision's `at` is wall-clock time)."""
    last = ((status or {}).get("plan") or {}).get("last_action")
    if not last:
        return History()
    try:
        return History(decisions=[Decision.model_validate(last)])
    except ValidationError:
        return History()


class DeploymentPlanner:
    """One MLLMDeployment's planner state across ticks (the driver's history)."""

    def __init__(self, ctx: OperatorContext, connector: KubeConnector, namespace: str, name: str,
                 settings: PlannerSettings) -> None:
        self.ctx, self.connector, self.namespace, self.name = ctx, connector, namespace, name
        self.settings = settings
        self.key = f"{namespace}/{name}"
        self.driver: Driver | None = None
        self.prometheus: PrometheusClient | None = None
        self._prometheus_url: str | None = None
        # spec.autoscaling.replanProfile as last loaded, and why it failed (retried each tick)
        self._profile: tuple[ReplanProfileSource | None, float, float] | None = None
        self.profile_error: str | None = None

    def _prom(self, url: str) -> PrometheusClient:
        if self.prometheus is None or url != self._prometheus_url:
            if self.prometheus is not None:
                self.prometheus.close()
            self.prometheus = PrometheusClient(url, timeout_s=self.settings.prometheus_timeout_s)
            self._prometheus_url = url
        return self.prometheus

    async def tick(self) -> float:
        """One decision; returns the seconds to wait for the next."""
        body = await self.ctx.kube.get(MLLM, self.namespace, self.name)
        if body is None:
            return 5.0
        try:
            spec = parse_spec(body.get("spec"), name=self.name)
        except InvalidSpecError:
            return 5.0  # reconcile reports InvalidSpec; nothing to plan on
        auto = spec.autoscaling
        policy = policy_config(auto, spec.slo.tbt_ms / 1000)
        if self.driver is None:
            self.driver = Driver(policy, DriverConfig(interval_s=auto.interval_seconds,
                                                      replan_interval_s=auto.replan_interval_seconds),
                                 self.settings.replanner, self.settings.metrics.view(self.key))
            self.driver.history = seed_history(body.get("status"))
        self.driver.policy = policy
        await self._replanner(body, auto.replan_profile, spec.slo.ttft_ms / 1000, spec.slo.tbt_ms / 1000)
        self.driver.cfg = self.driver.cfg.model_copy(update={"interval_s": auto.interval_seconds,
                                                             "replan_interval_s": auto.replan_interval_seconds})
        assert auto.prometheus_url is not None  # spec_problems requires it when enabled
        prom = self._prom(auto.prometheus_url)
        try:
            snap: Snapshot = await asyncio.to_thread(snapshot_from_prometheus, prom.query,
                                                     self.settings.promql_window)
        except (httpx.HTTPError, RuntimeError, KeyError, ValueError) as e:
            log.warning("%s/%s: no snapshot from %s: %s", self.namespace, self.name, auto.prometheus_url, e)
            return float(auto.interval_seconds)
        driver = self.driver
        decision = await asyncio.to_thread(driver.observe, snap, spec.counts())
        error = await self.connector.act(self.namespace, self.name, decision)
        driver.acted(decision, error)
        fresh = await self.ctx.kube.get(MLLM, self.namespace, self.name) or body
        if error is None and decision.action != "none" and not decision.dry_run:
            driver.counts = parse_spec(fresh.get("spec"), name=self.name).counts()
        await self.connector.record(fresh, decision, driver.document())
        return float(auto.interval_seconds)

    async def _replanner(self, body: Mapping[str, Any], source: ReplanProfileSource | None, ttft_slo_s: float,
                         tbt_slo_s: float) -> None:
        """(Re)load the replans' step times when spec.autoscaling.replanProfile or the SLOs
        change, and each tick while loading fails (the ConfigMap may come later); a failure
        is a Warning Event once per distinct error, and the other rules run without replans."""
        assert self.driver is not None
        wanted = (source, ttft_slo_s, tbt_slo_s)
        if wanted == self._profile and self.profile_error is None:
            return
        if source is None:
            self.driver.replanner, self.profile_error = self.settings.replanner, None
        else:
            try:
                self.driver.replanner = await load_replanner(self.ctx.kube, self.namespace, source, ttft_slo_s,
                                                             tbt_slo_s)
                self.driver.replan = None  # a new profile: replan at once
                self.profile_error = None
            except (ProfileSourceError, KubeApiError) as e:
                self.driver.replanner = None
                if str(e) != self.profile_error:
                    self.ctx.emit(body, "Warning", "PlannerProfileError", f"no replans: {e}")
                    log.warning("%s: no replans: %s", self.key, e)
                self.profile_error = str(e)
        self._profile = wanted

    def close(self) -> None:
        if self.prometheus is not None:
            self.prometheus.close()
        if self.driver is not None:
            self.driver.metrics.forget()


def _enabled(spec: Mapping[str, Any], **_: Any) -> bool:
    return bool((spec or {}).get("autoscaling", {}).get("enabled"))


def register_planner(registry: kopf.OperatorRegistry, ctx: OperatorContext,
                     settings: PlannerSettings | None = None) -> None:
    """The hook handlers.register calls: one planner daemon per autoscaled deployment."""
    s = settings or SETTINGS
    connectors: list[KubeConnector] = []
    planners: dict[str, DeploymentPlanner] = {}
    endpoints: list[PlannerEndpoint] = []

    def connector() -> KubeConnector:
        if not connectors:
            connectors.append(KubeConnector(ctx.kube, ctx.lock, ctx.emit, s.token_source,
                                            ctx.config.role_switch_timeout))
        return connectors[0]

    def index() -> PlanIndex:
        return PlanIndex({k: p.driver.document() for k, p in list(planners.items()) if p.driver is not None})

    @kopf.on.startup(registry=registry)
    def start_endpoint(**_: Any) -> None:
        if s.endpoint:
            host, _, port = s.endpoint.rpartition(":")
            endpoints.append(PlannerEndpoint(host or "0.0.0.0", int(port), s.metrics.registry, index).start())

    @kopf.daemon(*RESOURCE, registry=registry, when=_enabled, cancellation_timeout=5.0)
    async def planner(body: kopf.Body, stopped: kopf.DaemonStopped, **_: Any) -> None:
        meta = body["metadata"]
        planner = DeploymentPlanner(ctx, connector(), meta["namespace"], meta["name"], s)
        planners[planner.key] = planner
        try:
            while not stopped:
                try:
                    wait = await planner.tick()
                except (KubeApiError, httpx.HTTPError) as e:  # the next tick retries
                    log.warning("%s: planner tick failed: %s", planner.key, e)
                    wait = 5.0
                await stopped.wait(wait)
        finally:
            planners.pop(planner.key, None)
            planner.close()

    @kopf.on.cleanup(registry=registry)
    async def close_planner(**_: Any) -> None:
        for c in connectors:
            await c.aclose()
        for e in endpoints:
            e.stop()
