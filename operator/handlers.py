"""Thin kopf handlers: every event becomes a reconcile pass (reconcile.py) over one MLLMDeployment.

  create / update(spec) / resume   full pass (children + roles + status)
  timer                            full pass every `timer_interval` (catches missed events
                                   and hand edits of children, see drift.py)
  worker pod events                roles + status pass for the pod's deployment
  deleted (event)                  nothing to undo (children carry owner references); no
                                   finalizer, so deletion never waits for the operator
  planner daemon                   per deployment with spec.autoscaling.enabled (planner/k8s_daemon.py)

`register` binds the handlers to a registry so tests can run a fresh operator per test.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import httpx
import kopf

from triptych.kube import names
from triptych.kube.client import KubeApiError
from triptych.operator.context import OperatorContext
from triptych.operator.planner.k8s_daemon import register_planner
from triptych.operator.reconcile import reconcile

RESOURCE = (names.GROUP, names.VERSION, names.PLURAL)


def configure(settings: kopf.OperatorSettings) -> None:
    """kopf settings every run uses (production and tests)."""
    prefix = names.GROUP
    settings.persistence.finalizer = f"{prefix}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=prefix)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=prefix, key="last-handled-configuration")
    # No CRD/namespace scanning: the CRD is installed before the operator, and without it
    # the operator needs no RBAC on customresourcedefinitions or namespaces.
    settings.scanning.disabled = True
    settings.posting.reporting_component = names.OPERATOR_NAME
    settings.posting.event_name_prefix = "triptych-"


def _spawning_without_finalizer(registry: kopf.OperatorRegistry) -> None:
    """kopf gives every timer and daemon a finalizer, so that it can stop the timer before the resource
    goes; with it, a resource cannot be deleted while no operator runs. Our timer needs no
    such stop (a pass over a resource that is gone does nothing) and is stopped by its `when`
    filter once the DELETED event is seen, so the finalizer is turned off here (kopf's
    `on.timer` has no switch for it). This touches kopf's registry internals (kopf is pinned);
    tests/operator/test_op_integration.py fails if a finalizer appears again."""
    spawning = registry._spawning
    # The spawning handlers are the timer and the planner's daemon: kopf stops a daemon when
    # it sees the resource deleted; nothing of it must run to completion before that.
    spawning._handlers = [dataclasses.replace(h, requires_finalizer=False) for h in spawning._handlers]


async def _full_pass(ctx: OperatorContext, body: Any) -> None:
    try:
        await reconcile(ctx, body["metadata"]["namespace"], body["metadata"]["name"], apply_children=True)
    except (KubeApiError, httpx.HTTPError) as e:
        raise kopf.TemporaryError(f"reconcile failed, retrying: {e}", delay=ctx.config.retry_delay) from e


def register(registry: kopf.OperatorRegistry, ctx: OperatorContext) -> None:
    @kopf.on.login(registry=registry)
    def login(**_: Any) -> Any:
        return ctx.connect()

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        await ctx.aclose()

    @kopf.on.resume(*RESOURCE, registry=registry)
    @kopf.on.create(*RESOURCE, registry=registry)
    @kopf.on.update(*RESOURCE, field="spec", registry=registry)
    async def reconcile_deployment(body: kopf.Body, **_: Any) -> None:
        await _full_pass(ctx, body)

    # `when`: a deleted resource's timer stops at its DELETED event (no finalizer, see below).
    @kopf.timer(*RESOURCE, interval=ctx.config.timer_interval, initial_delay=ctx.config.timer_interval,
                when=lambda body, **_: not ctx.is_gone(body["metadata"]["uid"]), registry=registry)
    async def periodic(body: kopf.Body, **_: Any) -> None:
        await _full_pass(ctx, body)

    # An event handler, not `on.delete`: a deletion handler makes kopf put a finalizer on
    # every resource, and then a resource cannot be deleted while the operator is down.
    # Nothing needs undoing (children carry owner references); kopf also removes the
    # finalizer that earlier versions added, as no handler needs it any more.
    @kopf.on.event(*RESOURCE, registry=registry)
    async def deleted(event: kopf.RawEvent, body: kopf.Body, **_: Any) -> None:
        if event.get("type") == "DELETED":  # runs before kopf re-matches the timer's filter
            ctx.forget(body["metadata"]["namespace"], body["metadata"]["name"], uid=body["metadata"]["uid"])

    register_planner(registry, ctx)
    _spawning_without_finalizer(registry)

    worker_labels = {names.LABEL_DEPLOYMENT: kopf.PRESENT, names.LABEL_COMPONENT: names.COMPONENT_WORKER}

    @kopf.on.event("", "v1", "pods", labels=worker_labels, registry=registry)
    async def worker_pod_event(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
        meta = body["metadata"]
        try:
            await reconcile(ctx, meta["namespace"], meta["labels"][names.LABEL_DEPLOYMENT], apply_children=False)
        except (KubeApiError, httpx.HTTPError) as e:  # the timer retries; a pod event is not replayed
            logger.warning(f"role pass after pod event failed: {e}")
