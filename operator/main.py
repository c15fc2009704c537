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

logger = logging.getLogger("triptych.operator")


def _login() -> kopf.ConnectionInfo:
    return kopf.ConnectionInfo(**dataclasses.asdict(Login.auto()))


async def run(ctx: OperatorContext, *, namespaces: list[str], standalone: bool,
              settings: kopf.OperatorSettings | None = None, stop_flag: threading.Event | None = None,
              ready_flag: threading.Event | None = None, liveness_endpoint: str | None = None) -> None:
    """Run the operator until stopped (a signal in production, `stop_flag` in tests)."""
    registry = kopf.OperatorRegistry()
    register(registry, ctx)
    settings = settings or kopf.OperatorSettings()
    configure(settings)
    await kopf.operator(registry=registry, settings=settings, standalone=standalone,
                        clusterwide=not namespaces, namespaces=namespaces,
                        stop_flag=stop_flag, ready_flag=ready_flag, memo=kopf.Memo(),
                        liveness_endpoint=liveness_endpoint)


def cli_main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per API call is noise
    config = OperatorConfig(operator_namespace=os.environ.get("POD_NAMESPACE"))
    ctx = OperatorContext(connect=_login, config=config)
    # kopf's liveness endpoint for the operator pod's probe; TRIPTYCH_OPERATOR_HEALTH="" disables it.
    health = os.environ.get("TRIPTYCH_OPERATOR_HEALTH", "http://0.0.0.0:8080/healthz") or None
    asyncio.run(run(ctx, namespaces=list(args.namespace), standalone=bool(args.standalone),
                    liveness_endpoint=health))
    return 0
