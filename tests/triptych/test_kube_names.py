"""Golden values of the Kubernetes contract (DESIGN.md "Names to keep"): every other test
reads the names from triptych.kube.names, so this is the one place a renamed label breaks."""

from __future__ import annotations

from triptych.kube import names
from triptych.topology import InstanceType


def test_pod_labels_are_the_documented_strings() -> None:
    assert (names.LABEL_NAME, names.LABEL_INSTANCE, names.LABEL_COMPONENT, names.LABEL_PART_OF) == (
        "app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component",
        "app.kubernetes.io/part-of")
    assert names.LABEL_MANAGED_BY == "app.kubernetes.io/managed-by"
    assert names.LABEL_DEPLOYMENT == "triptych.dev/deployment"
    assert names.LABEL_POOL == "triptych.dev/pool"
    assert names.LABEL_ROLE == "triptych.dev/role"
    assert names.LABEL_LLMD_ROLE == "llm-d.ai/role"
    assert (names.COMPONENT_WORKER, names.COMPONENT_ROUTER) == ("worker", "router")


def test_annotations_are_the_documented_strings() -> None:
    assert names.ANNOTATION_DELETION_COST == "controller.kubernetes.io/pod-deletion-cost"
    assert names.ANNOTATION_SPEC_HASH == "triptych.dev/spec-hash"
    assert names.ANNOTATION_WORKERS == "triptych.dev/workers"  # shared-GPU pods: "EP=8100,D=8101"
    assert (names.PORT_NAME, names.DECODE_PORT_NAME) == ("http", "http-decode")
    assert int(names.REMOVAL_DELETION_COST) < 0  # below the default 0: these pods go first


def test_api_coordinates() -> None:
    assert (names.GROUP, names.VERSION, names.KIND, names.PLURAL, names.SHORT_NAMES) == (
        "triptych.dev", "v1alpha1", "MLLMDeployment", "mllmdeployments", ("mllm",))
    assert names.API_VERSION == "triptych.dev/v1alpha1"
    assert names.FIELD_MANAGER == "triptych-operator"


def test_role_label_values_are_the_instance_types() -> None:
    assert names.ROLES == {"E", "P", "D", "EP", "ED", "PD", "EPD", "V"}
    assert {t.value: v for t, v in names.LLMD_ROLES.items()} == {"P": "prefill", "D": "decode", "PD": "both"}
    assert set(names.LLMD_ROLES) <= set(InstanceType)


def test_worker_selector_is_what_the_router_watches() -> None:
    assert names.worker_selector("demo") == {"app.kubernetes.io/component": "worker",
                                             "triptych.dev/deployment": "demo"}
    assert (names.router_name("m"), names.workers_service_name("m"), names.config_map_name("m"),
            names.worker_deployment_name("m", "gpu")) == ("m-router", "m-workers", "m-config", "m-gpu")
