"""Role planning (pure): assignment, switches, scale-down marks; and the status built on it."""

from __future__ import annotations

from triptych.operator.roles import RoleChange, WorkerPod, plan_pool, role_labels
from triptych.operator.status import Observation, compute_status, merge_patch, transition
from triptych.topology import InstanceType

E, P, D, PD, EPD = InstanceType.E, InstanceType.P, InstanceType.D, InstanceType.PD, InstanceType.EPD


def pod(name: str, role: InstanceType | None = None, ready: bool = True, created: str | None = None,
        **kw: object) -> WorkerPod:
    return WorkerPod(name=name, role=role, ready=ready, ip="10.0.0.1", created=created or f"2026-01-01T00:00:{name[-2:]}Z",
                     **kw)  # type: ignore[arg-type]


def test_new_ready_pods_get_the_missing_roles_in_canonical_order() -> None:
    plan = plan_pool({E: 1, P: 1, D: 2}, [pod("w-01"), pod("w-02"), pod("w-03"), pod("w-04")])
    assert plan.changes == (RoleChange("w-01", None, E), RoleChange("w-02", None, P),
                            RoleChange("w-03", None, D), RoleChange("w-04", None, D))
    assert plan.remove == () and plan.waiting == 0


def test_pods_not_ready_or_without_ip_wait() -> None:
    pods = [pod("w-01"), pod("w-02", ready=False), WorkerPod("w-03", None, True, ip=None)]
    plan = plan_pool({P: 1, D: 2}, pods)
    assert plan.changes == (RoleChange("w-01", None, P),)
    assert plan.waiting == 2


def test_pods_yet_to_be_created_count_as_waiting() -> None:
    plan = plan_pool({E: 1, P: 1, D: 1}, [pod("w-01")])
    assert [c.new for c in plan.changes] == [E]
    assert plan.waiting == 2 and plan.remove == ()


def test_settled_pool_plans_nothing() -> None:
    plan = plan_pool({P: 1, D: 1}, [pod("w-01", P), pod("w-02", D)])
    assert plan.settled


def test_scale_down_marks_newest_surplus_and_keeps_wanted_roles() -> None:
    pods = [pod("w-01", E), pod("w-02", P), pod("w-03", D), pod("w-04", D), pod("w-05", D)]
    plan = plan_pool({E: 1, P: 1, D: 1}, pods)
    assert plan.remove == ("w-04", "w-05") and plan.changes == ()
    assert plan.excess == 2


def test_scale_down_prefers_not_ready_then_unassigned_pods() -> None:
    pods = [pod("w-01", D), pod("w-02", D, ready=False), pod("w-03"), pod("w-04", D)]
    plan = plan_pool({D: 1}, pods)
    assert set(plan.remove) == {"w-02", "w-03", "w-04"}
    plan = plan_pool({D: 2}, pods)
    assert set(plan.remove) == {"w-02", "w-03"}  # the not-ready pod, then the unassigned one


def test_marked_pods_are_unmarked_when_wanted_again() -> None:
    pods = [pod("w-01", D), pod("w-02", D, marked=True)]
    assert plan_pool({D: 2}, pods).unmark == ("w-02",)
    assert plan_pool({D: 1}, pods).remove == ()  # already marked: no second write
    assert plan_pool({D: 1}, pods).unmark == ()


def test_shift_between_types_switches_a_surplus_pod_in_place() -> None:
    pods = [pod("w-01", P), pod("w-02", P), pod("w-03", D)]
    plan = plan_pool({P: 1, D: 2}, pods)
    assert plan.changes == (RoleChange("w-02", P, D),)  # the newer P pod moves
    assert plan.remove == ()


def test_unassigned_pods_fill_shortages_before_serving_pods_switch() -> None:
    pods = [pod("w-01", P), pod("w-02", P), pod("w-03", D), pod("w-04")]
    plan = plan_pool({P: 2, D: 2}, pods)  # no excess: the unassigned pod takes the missing D
    assert plan.changes == (RoleChange("w-04", None, D),) and plan.remove == ()
    plan = plan_pool({P: 1, D: 2}, pods)  # one pod too many: the unassigned one goes, a P switches
    assert plan.remove == ("w-04",) and plan.changes == (RoleChange("w-02", P, D),)


def test_terminating_pods_are_ignored() -> None:
    pods = [pod("w-01", D, terminating=True), pod("w-02")]
    plan = plan_pool({D: 1}, pods)
    assert plan.changes == (RoleChange("w-02", None, D),)


def test_roles_outside_the_pool_types_are_surplus() -> None:
    plan = plan_pool({PD: 1}, [pod("w-01", EPD)])
    assert plan.changes == (RoleChange("w-01", EPD, PD),)


def test_llm_d_labels_mirror_only_known_roles() -> None:
    assert role_labels(P) == {"triptych.dev/role": "P", "llm-d.ai/role": "prefill"}
    assert role_labels(D)["llm-d.ai/role"] == "decode"
    assert role_labels(PD)["llm-d.ai/role"] == "both"
    assert role_labels(E)["llm-d.ai/role"] is None  # removed, never a misleading value


# --- status ---------------------------------------------------------------------------------

NOW, LATER = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def conditions(status: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_status_counts_roles_and_conditions() -> None:
    pods = {"w": [pod("w-01", E), pod("w-02", P), pod("w-03", D, ready=False), pod("w-04")]}
    counts = {"w": {E: 1, P: 1, D: 2}}
    obs = Observation(3, counts, pods, router_ready=1, plans={"w": plan_pool(counts["w"], pods["w"])})
    status = compute_status(obs, None, NOW)
    assert status["observedGeneration"] == 3
    assert status["topology"] == "1E1P2D" and status["instances"] == "2/4"
    assert status["instanceTypes"] == {"E": {"desired": 1, "ready": 1}, "P": {"desired": 1, "ready": 1},
                                       "D": {"desired": 2, "ready": 0}}
    assert [w["role"] for w in status["workers"]] == ["E", "P", "D", "unassigned"]
    assert conditions(status) == {"Ready": ("False", "InstancesNotReady"), "Progressing": ("True", "Reconciling"),
                                  "Degraded": ("False", "AsExpected")}
    assert "D 0/2" in status["conditions"][0]["message"]


def test_ready_needs_the_router_and_keeps_transition_times() -> None:
    pods = {"w": [pod("w-01", EPD)]}
    counts = {"w": {EPD: 1}}
    plans = {"w": plan_pool(counts["w"], pods["w"])}
    no_router = compute_status(Observation(1, counts, pods, 0, plans), None, NOW)
    assert conditions(no_router)["Ready"] == ("False", "RouterNotReady")
    ready = compute_status(Observation(1, counts, pods, 1, plans), no_router, LATER)
    assert conditions(ready)["Ready"] == ("True", "AllInstancesReady")
    times = {c["type"]: c["lastTransitionTime"] for c in ready["conditions"]}
    assert times == {"Ready": LATER, "Progressing": NOW, "Degraded": NOW}
    assert transition(no_router, ready, "Ready")["status"] == "True"
    assert transition(ready, compute_status(Observation(1, counts, pods, 1, plans), ready, LATER), "Ready") is None


def test_invalid_spec_status_and_failures() -> None:
    invalid = compute_status(Observation(2, invalid=("spec.topology: bad",)), {"topology": "1EPD"}, NOW)
    assert conditions(invalid)["Ready"] == ("False", "InvalidSpec")
    assert invalid["conditions"][0]["message"] == "spec.topology: bad"
    assert invalid["topology"] == "1EPD"  # last good view is kept
    failed = compute_status(Observation(2, {"w": {D: 1}}, {"w": [pod("w-01")]}, 1,
                                        failures=("w-01: unassigned -> D failed",)), None, NOW)
    assert conditions(failed)["Degraded"] == ("True", "RoleAssignmentFailed")


def test_merge_patch_is_minimal_and_removes_keys() -> None:
    old = {"a": 1, "b": {"x": 1, "y": 2}, "c": [1]}
    assert merge_patch(old, old) == {}
    assert merge_patch(old, {"a": 1, "b": {"x": 1}, "c": [2]}) == {"b": {"y": None}, "c": [2]}
    assert merge_patch({}, {"a": None}) == {"a": None}
