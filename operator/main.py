"""`triptych operator`: run the kopf operator (all namespaces unless --namespace is given).

Credentials come from the in-cluster service account or, outside a cluster, the current
kubeconfig context (`Login.auto()` in triptych/kube/client.py, the same loader the
router's discovery uses); kopf and the operator's own API client share that one login.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import threading

import kopf

from triptych.kube.client import Login
from triptych.operator.context import OperatorConfig, OperatorContext
from triptych.operator.handlers import configure, register
from triptych.operator.peering import ensure_peering, start_priority

logger = logging.getLogger("triptych.operator")


def _login() -> kopf.ConnectionInfo:
    return kopf.ConnectionInfo(**dataclasses.asdict(Login.auto()))


async def run(ctx: OperatorContext, *, namespaces: list[str], peering: str | None = None,
              priority: int | None = None, settings: kopf.OperatorSettings | None = None,
              stop_flag: threading.Event | None = None, ready_flag: threading.Event | None = None,
              liveness_endpoint: str | None = None) -> None:
    """Run the operator until stopped (a signal in production, `stop_flag` in tests).
    Without `peering` it runs standalone: the only replica, always active (peering.py)."""
    registry = kopf.OperatorRegistry()
    register(registry, ctx)
    settings = settings or kopf.OperatorSettings()
    configure(settings)
    if peering is not None:
        await ensure_peering(ctx.kube, peering, namespaces)
        priority = start_priority() if priority is None else priority
        logger.info("peering %r with priority %d: active only while no live peer has a higher one",
                    peering, priority)
    await kopf.operator(registry=registry, settings=settings, standalone=peering is None,
                        peering_name=peering, priority=priority,
                        clusterwide=not namespaces, namespaces=namespaces,
                        stop_flag=stop_flag, ready_flag=ready_flag, memo=kopf.Memo(),
                        liveness_endpoint=liveness_endpoint)


def cli_main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per API call is noise
    if args.peering and args.standalone:
        raise SystemExit("--peering and --standalone exclude each other")
    config = OperatorConfig(operator_namespace=os.environ.get("POD_NAMESPACE"))
    ctx = OperatorContext(connect=_login, config=config)
    # kopf's liveness endpoint for the operator pod's probe; TRIPTYCH_OPERATOR_HEALTH="" disables it.
    health = os.environ.get("TRIPTYCH_OPERATOR_HEALTH", "http://0.0.0.0:8080/healthz") or None
    asyncio.run(run(ctx, namespaces=list(args.namespace), peering=args.peering or None, priority=args.priority,
                    liveness_endpoint=health))
    return 0
