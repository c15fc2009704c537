"""Kubernetes names shared by the operator, the router's discovery, the CRD and the tests.

One place for API coordinates, label and annotation keys and child-object names, so the
operator that writes a label and the router that selects on it cannot drift apart. The
label and annotation strings are pinned by tests/triptych/test_kube_names.py: they are
part of the public contract (DESIGN.md "Names to keep"; llm-d and dashboards select on
them), so renaming one here must be a deliberate, test-breaking change.
"""

from __future__ import annotations

from triptych.topology import InstanceType

# --- the custom resource ------------------------------------------------------------------
GROUP = "triptych.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "MLLMDeployment"
PLURAL = "mllmdeployments"
SINGULAR = "mllmdeployment"
SHORT_NAMES = ("mllm",)

FIELD_MANAGER = "triptych-operator"
OPERATOR_NAME = "triptych-operator"

# --- pod and object labels (DESIGN.md "Names to keep") --------------------------------------
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_DEPLOYMENT = "triptych.dev/deployment"
LABEL_POOL = "triptych.dev/pool"
LABEL_ROLE = "triptych.dev/role"
LABEL_LLMD_ROLE = "llm-d.ai/role"

COMPONENT_WORKER = "worker"
COMPONENT_ROUTER = "router"

# --- annotations ----------------------------------------------------------------------------
ANNOTATION_SPEC_HASH = "triptych.dev/spec-hash"
ANNOTATION_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
# The value we write on pods chosen for removal; the ReplicaSet controller deletes the
# lowest cost first, and pods without the annotation count as 0.
REMOVAL_DELETION_COST = "-1000"

# On a pod that runs more than one worker (a shared-GPU pool: EP + D under MPS), the role and
# port of each, e.g. "EP=8100,D=8101"; the router's discovery makes one endpoint per entry.
# Such a pod's role label names its first worker (the operator never switches these roles).
ANNOTATION_WORKERS = "triptych.dev/workers"

# --- roles ------------------------------------------------------------------------------------
# The values a pod's triptych.dev/role label may hold: the instance types.
ROLES: frozenset[str] = frozenset(t.value for t in InstanceType)
# llm-d names prefill/decode/both; it has no encode stage, so E, EP, ED and EPD pods
# carry no llm-d label rather than a misleading one.
LLMD_ROLES: dict[InstanceType, str] = {
    InstanceType.P: "prefill",
    InstanceType.D: "decode",
    InstanceType.PD: "both",
}

# --- pod layout -------------------------------------------------------------------------------
DEFAULT_IMAGE = "ghcr.io/triptych/worker:0.1.0"
WORKER_PORT = 8100
ROUTER_PORT = 8000
PORT_NAME = "http"  # the container port name probes, Services and the router's discovery use
DECODE_PORT_NAME = "http-decode"  # the D worker's port on a shared-GPU pod
# NVIDIA MPS on a shared-GPU pod: the control daemon's pipe and log directories (emptyDirs).
MPS_PIPE_DIR = "/mps/pipe"
MPS_LOG_DIR = "/mps/log"
MODEL_MOUNT = "/models"
CONFIG_MOUNT = "/etc/triptych/config"
CONFIG_FILE = "serving.json"
SECRETS_MOUNT = "/etc/triptych/secrets"
TMP_SIZE_LIMIT = "2Gi"  # the /tmp emptyDir (caches, HOME): bounded so a pod cannot fill its node's disk

# --- the internal plane's tokens (one Secret per MLLMDeployment, created by the operator) -----
SECRET_KEY_INTERNAL_TOKEN = "internal-token"  # /internal/*: the router and peer workers
SECRET_KEY_ADMIN_TOKEN = "admin-token"  # /admin/*: the operator (role switches), planner, humans
ENV_INTERNAL_TOKEN = "TRIPTYCH_INTERNAL_TOKEN"
ENV_ADMIN_TOKEN = "TRIPTYCH_ADMIN_TOKEN"

# --- worker shutdown ----------------------------------------------------------------------------
WORKER_DRAIN_TIMEOUT_S = 60  # worker/settings.py drain_timeout_s: SIGTERM drains up to this long
PRESTOP_SLEEP_S = 5  # before SIGTERM: endpoints and the router's pod watch drop the pod first
GRACE_MARGIN_S = 15  # after the drain: teardown (NIXL agent, weights) before SIGKILL


# --- child objects ------------------------------------------------------------------------------

def worker_deployment_name(deployment: str, pool: str) -> str:
    return f"{deployment}-{pool}"


def router_name(deployment: str) -> str:
    return f"{deployment}-router"


def workers_service_name(deployment: str) -> str:
    return f"{deployment}-workers"


def config_map_name(deployment: str) -> str:
    return f"{deployment}-config"


def tokens_secret_name(deployment: str) -> str:
    return f"{deployment}-tokens"


def worker_selector(deployment: str) -> dict[str, str]:
    """The labels that select every worker pod of one MLLMDeployment (the router's discovery)."""
    return {LABEL_COMPONENT: COMPONENT_WORKER, LABEL_DEPLOYMENT: deployment}
