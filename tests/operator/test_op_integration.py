"""The operator end to end: real kopf runtime against kmock, tests playing the controllers."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from kube_harness import APPLY, Env, wait_for

from triptych.kube import names

pytestmark = pytest.mark.timeout(90)


def spec(port: int, topology: dict[str, int] | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "model": {"source": {"tiny": "qwen2-vl"}, "dtype": "float32"},
        "topology": topology or {"E": 1, "P": 1, "D": 1},
        "pools": [{"name": "cpu", "port": port}],
        **extra,
    }


def children(env: Env) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for res in ("v1/configmaps", "v1/services", "v1/serviceaccounts", "apps/v1/deployments",
                "policy/v1/poddisruptionbudgets", "networking.k8s.io/v1/networkpolicies",
                "rbac.authorization.k8s.io/v1/rolebindings"):
        out[res] = set(env.api.all(res))
    return out


async def test_create_makes_children_with_owner_refs_and_status(env: Env) -> None:
    env.start_operator()
    await env.cluster.create_mllm("demo", spec(env.cluster.worker_port))
    mllm = await wait_for(lambda: (env.cluster.mllm("demo") or {}).get("status", {}).get("conditions"),
                          what="status conditions")
    uid = env.cluster.mllm("demo")["metadata"]["uid"]
    kids = children(env)
    assert kids["apps/v1/deployments"] == {"demo-cpu", "demo-router"}
    assert kids["v1/services"] == {"demo-workers", "demo-router"}
    assert kids["v1/configmaps"] == {"demo-config"}
    assert kids["policy/v1/poddisruptionbudgets"] == {"demo-cpu", "demo-router"}
    assert kids["networking.k8s.io/v1/networkpolicies"] == {"demo-workers"}
    for res, objs in kids.items():
        for name in objs:
            meta = env.api.get(res, name)["metadata"]
            assert meta["ownerReferences"] == [{"apiVersion": names.API_VERSION, "kind": names.KIND,
                                                "name": "demo", "uid": uid, "controller": True}], (res, name)
            assert meta["labels"][names.LABEL_DEPLOYMENT] == "demo"
            assert meta["labels"][names.LABEL_INSTANCE] == "demo"
    workers = env.api.get("apps/v1/deployments", "demo-cpu")
    assert workers["spec"]["replicas"] == 3
    assert names.LABEL_ROLE not in workers["spec"]["selector"]["matchLabels"]
    status = env.cluster.mllm("demo")["status"]
    assert status["topology"] == "1E1P1D"
    assert status["instances"] == "0/3"
    ready = {c["type"]: c for c in mllm}["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "InstancesNotReady")
    # no finalizer: deleting the resource never waits for the operator (owner references suffice)
    assert not env.cluster.mllm("demo")["metadata"].get("finalizers")
    # the tokens Secret is created once (POST, never applied: a pass must not rewrite its tokens)
    secret = env.api.get("v1/secrets", "demo-tokens")
    assert secret["metadata"]["ownerReferences"][0]["uid"] == uid
    assert set(secret["data"]) == {names.SECRET_KEY_INTERNAL_TOKEN, names.SECRET_KEY_ADMIN_TOKEN}
    assert [r.method for r in env.writes() if r.resource is not None and r.resource.plural == "secrets"] == ["POST"]
    # every other child write was a server-side apply by our field manager
    applies = [r for r in env.writes() if r.resource is not None and r.resource.plural != names.PLURAL
               and r.resource.plural not in ("events", "secrets")]
    assert applies
    for r in applies:
        assert r.headers["Content-Type"] == APPLY, r
        assert r.params["fieldManager"] == names.FIELD_MANAGER
        assert r.params["force"] == "true"


async def test_pods_get_roles_through_worker_admin_endpoint(env: Env) -> None:
    env.start_operator()
    await env.cluster.create_mllm("demo", spec(env.cluster.worker_port, {"E": 1, "P": 1, "D": 2}))
    await wait_for(lambda: env.api.get("apps/v1/deployments", "demo-cpu"), what="worker deployment")
    await env.cluster.reconcile_replicas()

    def roles() -> dict[str, str | None]:
        return {n: p["metadata"]["labels"].get(names.LABEL_ROLE) for n, p in env.cluster.pods().items()}

    await wait_for(lambda: all(roles().values()), what="every pod labelled with a role")
    assert sorted(roles().values()) == ["D", "D", "E", "P"]
    for name, pod in env.cluster.pods().items():
        worker = env.cluster.workers[name]
        role = pod["metadata"]["labels"][names.LABEL_ROLE]
        assert worker.calls == [role]  # the worker was switched once, before the relabel
        assert worker.role == role
        llmd = {"P": "prefill", "D": "decode"}.get(role)
        assert pod["metadata"]["labels"].get(names.LABEL_LLMD_ROLE) == llmd
    await env.cluster.set_router_ready("demo")
    await wait_for(lambda: (env.cluster.condition("demo", "Ready") or {}).get("status") == "True",
                   what="Ready=True")
    status = env.cluster.mllm("demo")["status"]
    assert status["instances"] == "4/4"
    assert status["instanceTypes"] == {"E": {"desired": 1, "ready": 1}, "P": {"desired": 1, "ready": 1},
                                       "D": {"desired": 2, "ready": 2}}
    assert {w["name"]: w["role"] for w in status["workers"]} == roles()
    assert env.cluster.condition("demo", "Progressing")["reason"] == "Stable"


def sent(request: Any) -> Any:
    """The body exactly as the client sent it (the emulator stamps metadata into `.data`)."""
    return json.loads(request.body)


def child_writes(env: Env, since: int) -> list[Any]:
    return [r for r in env.writes(since) if r.resource is not None
            and r.resource.plural not in (names.PLURAL, "events", "pods")]


async def settle(env: Env, name: str, count: int) -> None:
    """Play the controllers until `count` worker pods carry roles and the router is ready."""
    await wait_for(lambda: env.api.get("apps/v1/deployments", f"{name}-router"), what="router deployment")
    await env.cluster.reconcile_replicas()
    await env.cluster.set_router_ready(name)
    await wait_for(lambda: (env.cluster.condition(name, "Ready") or {}).get("status") == "True",
                   what="Ready=True")
    assert len(env.cluster.pods()) == count


async def test_spec_change_patches_only_the_changed_objects(env: Env) -> None:
    port = env.cluster.worker_port
    pools = [{"name": "enc", "instanceTypes": ["E"], "port": port},
             {"name": "llm", "instanceTypes": ["P", "D"], "port": port}]
    env.start_operator()
    await env.cluster.create_mllm("demo", spec(port, {"E": 1, "P": 1, "D": 1}, pools=pools))
    await settle(env, "demo", 3)
    before = {res: set(objs) for res, objs in children(env).items()}
    mark = env.mark()

    await env.cluster.patch_mllm("demo", {"spec": {"topology": {"D": 2}}})
    await wait_for(lambda: env.api.get("apps/v1/deployments", "demo-llm")["spec"]["replicas"] == 3,
                   what="llm pool scaled to 3")
    await env.cluster.reconcile_replicas()
    await wait_for(lambda: env.cluster.mllm("demo")["status"]["instances"] == "4/4", what="4/4 ready")

    writes = child_writes(env, mark)
    assert sorted((r.resource.plural, r.name) for r in writes) == [
        ("configmaps", "demo-config"), ("deployments", "demo-llm")]
    for r in writes:
        assert r.method == "PATCH" and r.headers["Content-Type"] == APPLY
        assert r.params == {"fieldManager": names.FIELD_MANAGER, "force": "true"}
    (scaled,) = [r for r in writes if r.name == "demo-llm"]
    assert sent(scaled)["spec"]["replicas"] == 3 and sent(scaled)["metadata"]["name"] == "demo-llm"
    assert {res: set(objs) for res, objs in children(env).items()} == before  # no duplicates
    assert env.api.get("apps/v1/deployments", "demo-enc")["spec"]["replicas"] == 1
    mllm = env.cluster.mllm("demo")
    assert mllm["metadata"]["generation"] == 2
    assert all(c["observedGeneration"] == 2 for c in mllm["status"]["conditions"])
    assert mllm["status"]["observedGeneration"] == 2


async def test_scale_down_marks_the_right_pods_before_replicas_drop(env: Env) -> None:
    env.start_operator()
    await env.cluster.create_mllm("demo", spec(env.cluster.worker_port, {"E": 1, "P": 1, "D": 3}))
    await settle(env, "demo", 5)
    pods = env.cluster.pods()
    by_role = {}
    for name in sorted(pods):
        by_role.setdefault(pods[name]["metadata"]["labels"][names.LABEL_ROLE], []).append(name)
    mark = env.mark()

    await env.cluster.patch_mllm("demo", {"spec": {"topology": {"D": 1}}})
    await wait_for(lambda: env.api.get("apps/v1/deployments", "demo-cpu")["spec"]["replicas"] == 3,
                   what="replicas 3")
    costs = {n: (p["metadata"].get("annotations") or {}).get(names.ANNOTATION_DELETION_COST)
             for n, p in env.cluster.pods().items()}
    # the two newest decode pods go; the oldest decode pod and E/P stay unmarked
    doomed = sorted(by_role["D"])[1:]
    assert {n for n, c in costs.items() if c == names.REMOVAL_DELETION_COST} == set(doomed)
    writes = env.writes(mark)
    mark_ids = [r.id for r in writes if r.resource and r.resource.plural == "pods"]
    scale_id = next(r.id for r in writes if r.name == "demo-cpu" and r.resource.plural == "deployments")
    assert len(mark_ids) == 2 and max(mark_ids) < scale_id, "deletion costs must be set before replicas drop"
    assert all(r.headers["Content-Type"] == "application/merge-patch+json" for r in writes
               if r.resource and r.resource.plural == "pods")

    await env.cluster.reconcile_replicas()  # the ReplicaSet deletes the cheapest pods
    assert set(env.cluster.pods()) == set(pods) - set(doomed)
    await wait_for(lambda: env.cluster.mllm("demo")["status"]["instances"] == "3/3", what="3/3")
    assert not any(env.cluster.workers[n].calls[1:] for n in env.cluster.pods())  # no role switches


async def test_shifted_counts_switch_a_role_in_place(env: Env) -> None:
    env.start_operator()
    await env.cluster.create_mllm("demo", spec(env.cluster.worker_port, {"E": 1, "P": 2, "D": 1}))
    await settle(env, "demo", 4)
    await env.cluster.patch_mllm("demo", {"spec": {"topology": {"P": 1, "D": 2}}})

    def roles() -> list[str]:
        return sorted(p["metadata"]["labels"][names.LABEL_ROLE] for p in env.cluster.pods().values())

    await wait_for(lambda: roles() == ["D", "D", "E", "P"], what="one P switched to D")
    switched = [n for n, w in env.cluster.workers.items() if w.calls == ["P", "D"]]
    assert len(switched) == 1
    assert env.cluster.pods()[switched[0]]["metadata"]["labels"][names.LABEL_LLMD_ROLE] == "decode"
    assert len(env.cluster.pods()) == 4


async def test_operator_restart_makes_no_writes(env: Env) -> None:
    first = env.start_operator()
    await env.cluster.create_mllm("demo", spec(env.cluster.worker_port, {"EP": 1, "D": 1}))
    await settle(env, "demo", 2)
    await asyncio.sleep(1.0)  # let in-flight passes finish
    await first.stop()
    mark = env.mark()

    env.start_operator()

    def full_passes() -> int:
        return sum(1 for r in list(env.api)[mark:] if r.method == "GET" and r.resource is not None
                   and r.resource.plural == "configmaps")

    await wait_for(lambda: full_passes() >= 3, what="resume + timer passes")
    assert env.writes(mark) == []


async def test_invalid_spec_sets_invalid_spec_and_creates_nothing(env: Env) -> None:
    op = env.start_operator()
    bad = spec(env.cluster.worker_port, {"E": 1, "P": 1, "D": 1},
               pools=[{"name": "a", "instanceTypes": ["E", "P"], "port": env.cluster.worker_port}])
    await env.cluster.create_mllm("bad", bad)
    ready = await wait_for(lambda: env.cluster.condition("bad", "Ready"), what="Ready condition")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert "no pool allows instance type D" in ready["message"]
    await wait_for(lambda: any(r == "InvalidSpec" for _, r, _ in op.events), what="event")
    event = await wait_for(lambda: [e for e in env.api.all("v1/events").values() if e["reason"] == "InvalidSpec"],
                           what="InvalidSpec Event object")
    assert event[0]["type"] == "Warning" and "D" in event[0]["message"]
    assert event[0]["involvedObject"]["name"] == "bad"
    await asyncio.sleep(1.2)  # two timer passes: still nothing, and no repeated events
    assert all(not objs for objs in children(env).values())
    assert [r for _, r, _ in op.events].count("InvalidSpec") == 1

    await env.cluster.patch_mllm("bad", {"spec": {"pools": [{"name": "a", "instanceTypes": ["E", "P", "D"],
                                                             "port": env.cluster.worker_port}]}})
    await wait_for(lambda: env.api.get("apps/v1/deployments", "bad-a"), what="children after the fix")
    await wait_for(lambda: env.cluster.condition("bad", "Ready")["reason"] == "InstancesNotReady",
                   what="InvalidSpec cleared")


async def test_schema_violation_is_invalid_spec(env: Env) -> None:
    env.start_operator()
    await env.cluster.create_mllm("bad", spec(70000))
    ready = await wait_for(lambda: env.cluster.condition("bad", "Ready"), what="Ready condition")
    assert ready["reason"] == "InvalidSpec" and "spec.pools[0].port" in ready["message"]
    assert all(not objs for objs in children(env).values())


async def test_spec_turning_invalid_leaves_children_untouched(env: Env) -> None:
    env.start_operator()
    await env.cluster.create_mllm("demo", spec(env.cluster.worker_port))
    await settle(env, "demo", 3)
    before = {res: {n: env.api.get(res, n) for n in objs} for res, objs in children(env).items()}
    mark = env.mark()
    await env.cluster.patch_mllm("demo", {"spec": {"topology": {"E": 0, "P": 0, "D": 0}}})
    ready = await wait_for(lambda: env.cluster.condition("demo", "Ready")["reason"] == "InvalidSpec"
                           and env.cluster.condition("demo", "Ready"), what="InvalidSpec")
    assert "no instances" in ready["message"]
    await asyncio.sleep(1.2)  # timer passes too
    assert child_writes(env, mark) == []
    assert not [r for r in env.writes(mark) if r.resource and r.resource.plural == "pods"]
    assert {res: {n: env.api.get(res, n) for n in objs} for res, objs in children(env).items()} == before


async def test_refused_role_switch_is_degraded_then_retried(env: Env) -> None:
    op = env.start_operator()
    await env.cluster.create_mllm("demo", spec(env.cluster.worker_port, {"EPD": 1}))
    await wait_for(lambda: env.api.get("apps/v1/deployments", "demo-cpu"), what="deployment")
    await env.cluster.reconcile_replicas()
    (pod,) = env.cluster.pods()
    env.cluster.workers[pod].refuse = True
    degraded = await wait_for(lambda: (env.cluster.condition("demo", "Degraded") or {}).get("status") == "True"
                              and env.cluster.condition("demo", "Degraded"), what="Degraded")
    assert degraded["reason"] == "RoleAssignmentFailed" and pod in degraded["message"]
    assert names.LABEL_ROLE not in env.cluster.pods()[pod]["metadata"]["labels"]
    assert any(r == "RoleAssignmentFailed" for _, r, _ in op.events)
    env.cluster.workers[pod].refuse = False
    await wait_for(lambda: env.cluster.pods()[pod]["metadata"]["labels"].get(names.LABEL_ROLE) == "EPD",
                   what="retried by the timer")
    await wait_for(lambda: env.cluster.condition("demo", "Degraded")["status"] == "False", what="recovered")


async def test_the_finalizer_of_earlier_versions_is_released(env: Env) -> None:
    finalizer = f"{names.GROUP}/finalizer"
    await env.cluster.request("POST", f"/apis/{names.API_VERSION}/namespaces/serving/{names.PLURAL}", {
        "apiVersion": names.API_VERSION, "kind": names.KIND,
        "metadata": {"name": "demo", "namespace": "serving", "finalizers": [finalizer]},
        "spec": spec(env.cluster.worker_port)})
    env.start_operator()
    await wait_for(lambda: not env.cluster.mllm("demo")["metadata"].get("finalizers"), what="finalizer released")
    await env.cluster.delete_mllm("demo")
    await wait_for(lambda: env.cluster.mllm("demo") is None, what="object gone")
    # kopf may send its JSON-patch removal of the finalizer twice (from two event cycles); the
    # emulator fails the second as an API server would (422), and kopf moves on.
    env.api.errors[:] = [e for e in env.api.errors if type(e).__name__ != "JsonPatchPathNotFound"]


@pytest.mark.parametrize("service_monitors", [True])
async def test_service_monitor_follows_the_crd_and_the_spec(env: Env) -> None:
    env.start_operator()
    await env.cluster.create_mllm("demo", spec(env.cluster.worker_port))
    monitor = await wait_for(lambda: env.api.get("monitoring.coreos.com/v1/servicemonitors", "demo"),
                             what="ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    await env.cluster.patch_mllm("demo", {"spec": {"monitoring": {"serviceMonitor": False},
                                                   "networkPolicy": {"enabled": False}}})
    await wait_for(lambda: env.api.get("monitoring.coreos.com/v1/servicemonitors", "demo") is None,
                   what="ServiceMonitor pruned")
    await wait_for(lambda: env.api.get("networking.k8s.io/v1/networkpolicies", "demo-workers") is None,
                   what="NetworkPolicy pruned")


async def test_namespace_flag_restricts_the_operator(env: Env) -> None:
    env.start_operator(namespaces=["serving"])
    await env.cluster.create_mllm("elsewhere", spec(env.cluster.worker_port), namespace="other")
    await env.cluster.create_mllm("demo", spec(env.cluster.worker_port))
    await wait_for(lambda: env.api.get("apps/v1/deployments", "demo-cpu"), what="served namespace")
    await asyncio.sleep(1.0)  # two timer intervals
    assert env.api.all("apps/v1/deployments", namespace="other") == {}
    assert "status" not in env.api.get(f"{names.API_VERSION}/{names.PLURAL}", "elsewhere", namespace="other")


async def test_deleting_needs_no_operator_and_stops_its_timer(env: Env) -> None:
    op = env.start_operator()
    await env.cluster.create_mllm("demo", spec(env.cluster.worker_port))
    await wait_for(lambda: (env.cluster.mllm("demo") or {}).get("status", {}).get("conditions"), what="status")
    await asyncio.sleep(1.0)  # a few timer ticks
    assert not env.cluster.mllm("demo")["metadata"].get("finalizers")
    await env.cluster.delete_mllm("demo")
    await wait_for(lambda: env.cluster.mllm("demo") is None, what="deleted")
    await asyncio.sleep(0.5)
    mark = env.mark()
    await asyncio.sleep(1.5)  # timer_interval is 0.5 s: a timer left running would GET the resource
    gets = [r for r in list(env.api)[mark:] if r.resource is not None and r.resource.plural == names.PLURAL
            and r.name == "demo"]
    assert gets == []
    await op.stop()
    # with no operator running, a resource is deleted at once
    await env.cluster.create_mllm("other", spec(env.cluster.worker_port))
    await env.cluster.delete_mllm("other")
    assert env.cluster.mllm("other") is None
