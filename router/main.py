"""`triptych router`: the HTTP layer (api.py) over the orchestrator, with discovery.

Static discovery (local mode) takes worker URLs from the command line; Kubernetes
discovery watches the deployment's worker pods. Either way the registry then learns each
worker's role and load from its `/health` every poll interval.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Gauge

from triptych.router.admin import add_admin_routes
from triptych.router.api import create_app
from triptych.router.config import RouterConfig
from triptych.router.http_server import check_bind, run
from triptych.router.metrics import PREFIX
from triptych.router.orchestrator import Orchestrator, OrchestratorConfig
from triptych.router.registry import Registry
from triptych.router.routing import Chooser, Policy, parse_stage_policies
from triptych.router.stage_client import worker_client
from triptych.router.video_decode import VideoDispatcher

log = logging.getLogger("triptych.router")


def build(config: RouterConfig, worker_urls: list[str], chooser: Chooser | None = None,
          orchestrator_config: OrchestratorConfig | None = None, poll_interval_s: float = 1.0,
          discovery: object | None = None) -> FastAPI:
    """The router app with its orchestrator; the registry is polled while the app runs.
    `discovery` (a KubernetesDiscovery) replaces the static URL list when given."""
    registry = Registry(worker_urls, poll_interval_s=poll_interval_s)
    client = worker_client(config.load_internal_token())
    metrics = CollectorRegistry()
    Gauge(f"{PREFIX}_slo_attainment_target", "The share of requests that should meet the SLO "
          "(compare triptych_frontend_slo_attainment)", ["model"],
          registry=metrics).labels(config.model_name).set(config.slo_attainment_target)
    videos = VideoDispatcher(client, str(config.model))
    Gauge(f"{PREFIX}_video_queued_gop_sets", "GOP sets planned and not yet decoded by a V instance (waiting for "
          "a decoder slot or decoding); the planner scales V on it", registry=metrics
          ).set_function(lambda: videos.queued_gop_sets)
    orchestrator = Orchestrator(registry, client, chooser or Chooser(), orchestrator_config, metrics,
                                videos=videos)
    app = create_app(config, orchestrator, registry=metrics)
    add_admin_routes(app, registry, client, config.load_admin_token(), static_discovery=discovery is None)
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(app_: FastAPI) -> AsyncIterator[None]:
        stop = asyncio.Event()
        tasks = []
        if discovery is not None:
            await discovery.start()
            tasks.append(asyncio.create_task(_follow(discovery, registry, stop)))
        await registry.refresh(client)
        tasks.append(asyncio.create_task(registry.run(client, stop)))
        try:
            async with inner(app_):
                yield
        finally:
            stop.set()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if discovery is not None:
                await discovery.stop()
            await orchestrator.stages.aclose()
            await client.aclose()

    app.router.lifespan_context = lifespan
    app.state.registry = registry
    app.state.orchestrator = orchestrator
    return app


async def _follow(discovery: object, registry: Registry, stop: asyncio.Event, interval_s: float = 1.0) -> None:
    """Mirror the discovered (Ready, role-confirmed) pods into the registry."""
    while not stop.is_set():
        registry.set_urls([e.url for e in discovery.current()])  # type: ignore[attr-defined]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval_s)


def _discovery(args: argparse.Namespace) -> object | None:
    if getattr(args, "discovery", "static") != "kubernetes":
        return None
    if not args.k8s_deployment:
        raise SystemExit("--discovery kubernetes needs --k8s-deployment")
    from triptych.router.k8s_discovery import KubernetesDiscovery

    return KubernetesDiscovery(args.k8s_namespace or _own_namespace(), args.k8s_deployment)


def _own_namespace() -> str:
    """The pod's namespace: POD_NAMESPACE (downward API), else the service account's."""
    sa = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    return os.environ.get("POD_NAMESPACE") or (sa.read_text().strip() if sa.is_file() else "default")


def cli_main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = RouterConfig.from_cli(args)
    try:
        chooser = Chooser(Policy(args.routing_policy), parse_stage_policies(args.stage_policy))
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    orch = OrchestratorConfig(stage_timeout_s=args.stage_timeout, parallel_encode=not args.no_parallel_encode,
                              cache_affinity=not args.no_cache_affinity,
                              prefix_routing=not args.no_prefix_routing, prefix_weight=args.prefix_routing_weight,
                              prefix_min_tokens=args.prefix_routing_min_tokens,
                              max_inflight=args.max_inflight_requests, max_instance_load=args.max_instance_load,
                              stage_channel=not args.no_stage_channel)
    check_bind(args.host, config, getattr(args, "allow_no_api_key", False))
    app = build(config, list(args.workers), chooser, orch, discovery=_discovery(args))
    run(app, args.host, args.port, config, getattr(args, "fd", None))
    return 0
