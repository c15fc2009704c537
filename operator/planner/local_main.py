"""`triptych autoscale`: the planner as its own process beside a local deployment
(`triptych serve --autoscale` starts it).

Every `--interval` seconds: the router's admin `/health` says which instances run which
role; one scrape of the router's and each worker's `/metrics` (signals.Scraper, rates from
the previous scrape) gives the Snapshot; the driver decides; the LocalConnector acts
through the router's `POST /admin/role`, and with `--spawn-spec` (which `serve` passes)
scales E and V by starting and stopping instance processes (local_spawn.py). `/metrics`
and `/plan` are served on `--port`.
With `--profile` (or `--gpu` and `--model`) the driver also replans on the recent
workload every `--replan-interval` seconds.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading

import httpx

from triptych.operator.planner.driver import Driver, DriverConfig, PlannerMetrics, Replanner
from triptych.operator.planner.endpoint import PlannerEndpoint
from triptych.operator.planner.local_connector import LocalActionError, LocalConnector
from triptych.operator.planner.policy_types import Decision, PolicyConfig
from triptych.operator.planner.signals import Scraper
from triptych.topology import InstanceType

log = logging.getLogger("triptych.planner")


def policy_from_args(args: argparse.Namespace) -> PolicyConfig:
    limits = {}
    for item in args.limit or []:
        kind, _, bounds = item.partition("=")
        lo, _, hi = bounds.partition(":")
        limits[InstanceType(kind)] = (int(lo), int(hi))
    return PolicyConfig(
        dry_run=args.dry_run, role_switching=not args.no_role_switching, encoder_scaling=not args.no_encoder_scaling,
        scale_up_cooldown_s=args.scale_up_cooldown, scale_down_cooldown_s=args.scale_down_cooldown,
        role_switch_cooldown_s=args.role_switch_cooldown, limits=limits, sustain=args.sustain,
        max_queue_per_instance=args.max_queue_per_instance, divergence_on=args.divergence_on,
        divergence_off=args.divergence_off, encode_up=args.encode_up, encode_down=args.encode_down,
        replan_gain=args.replan_gain, decode_scaling=not args.no_decode_scaling, slo_tbt_s=args.slo_tbt,
        decode_up=args.decode_up, decode_down=args.decode_down, video_scaling=not args.no_video_scaling,
        video_up=args.video_up, video_down=args.video_down)


def replanner_from_args(args: argparse.Namespace) -> Replanner | None:
    if not (args.profile or args.gpu):
        return None
    from triptych.operator.planner.model_shape import read_shape
    from triptych.operator.planner.profile import StepProfile
    from triptych.operator.planner.replanner import WindowReplanner
    from triptych.operator.planner.roofline import roofline_profile
    from triptych.operator.planner.simulator import SimConfig

    if args.profile:
        profile = StepProfile.load(args.profile)
    elif args.model:
        profile = roofline_profile(read_shape(args.model), args.gpu)
    else:
        raise SystemExit("--gpu needs --model (its config.json)")
    return WindowReplanner(profile, SimConfig(ttft_slo_s=args.slo_ttft, tbt_slo_s=args.slo_tbt))


class LocalPlanner:
    """One tick = one decision; `run` repeats it until stopped."""

    def __init__(self, router_url: str, driver: Driver, connector: LocalConnector, scraper: Scraper) -> None:
        self.router_url = router_url.rstrip("/")
        self.driver = driver
        self.connector = connector
        self.scraper = scraper

    def tick(self) -> Decision | None:
        try:
            instances = self.connector.instances()
            self.scraper.urls = [self.router_url, *(str(i["url"]) for i in instances if i.get("url"))]
            snap = self.scraper.snapshot()
        except (httpx.HTTPError, LocalActionError, ValueError) as e:
            log.warning("no snapshot this interval: %s", e)
            return None
        decision = self.driver.observe(snap, self.connector.counts(instances))
        error = self.connector.act(decision)
        self.driver.acted(decision, error)
        if decision.action != "none":
            log.info("%s%s: %s%s", "dry run: " if decision.dry_run else "", decision.action, decision.reason,
                     f" (failed: {error})" if error else "")
        return decision

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.tick()
            stop.wait(self.driver.cfg.interval_s)


def cli_main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    token = open(args.admin_token_file).read().strip() if args.admin_token_file else None
    metrics = PlannerMetrics(deployment="local")
    driver = Driver(policy_from_args(args), DriverConfig(interval_s=args.interval,
                                                         replan_interval_s=args.replan_interval),
                    replanner_from_args(args), metrics)
    spawner = None
    if getattr(args, "spawn_spec", None):
        from triptych.local_spawn import InstanceSpawner, SpawnSpec

        spawner = InstanceSpawner(SpawnSpec.read(args.spawn_spec))
    connector = LocalConnector(args.router, token, spawner=spawner)
    planner = LocalPlanner(args.router, driver, connector, Scraper([args.router]))
    endpoint = PlannerEndpoint(args.host, args.port, metrics.registry, driver.document).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"planner: /metrics and /plan at {endpoint.url}", flush=True)
    try:
        planner.run(stop)
    finally:
        endpoint.stop()
        connector.close()
    return 0
