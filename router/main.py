"""`triptych router`: the HTTP layer (api.py) over the orchestrator, with discovery.

Static discovery (local mode) takes worker URLs from the command line; the registry then
learns each worker's role and load from its `/health` every poll interval.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import uvicorn
from fastapi import FastAPI

from triptych.router.api import create_app
from triptych.router.config import RouterConfig
from triptych.router.orchestrator import Orchestrator, OrchestratorConfig
from triptych.router.planner import Chooser, Policy
from triptych.router.registry import Registry

log = logging.getLogger("triptych.router")


def build(config: RouterConfig, worker_urls: list[str], policy: Policy = Policy.ROUND_ROBIN,
          orchestrator_config: OrchestratorConfig | None = None, poll_interval_s: float = 1.0) -> FastAPI:
    """The router app with its orchestrator; the registry is polled while the app runs."""
    registry = Registry(worker_urls, poll_interval_s=poll_interval_s)
    client = httpx.AsyncClient(limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))
    orchestrator = Orchestrator(registry, client, Chooser(policy), orchestrator_config)
    app = create_app(config, orchestrator)
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(app_: FastAPI) -> AsyncIterator[None]:
        stop = asyncio.Event()
        await registry.refresh(client)
        poller = asyncio.create_task(registry.run(client, stop))
        try:
            async with inner(app_):
                yield
        finally:
            stop.set()
            await poller
            await client.aclose()

    app.router.lifespan_context = lifespan
    app.state.registry = registry
    app.state.orchestrator = orchestrator
    return app


def cli_main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = RouterConfig.from_cli(args)
    app = build(config, list(args.workers))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=10)
    return 0
