"""The router objects: ServiceAccount + RoleBinding (pod watch for discovery), Deployment, Service. Pure."""

from __future__ import annotations

from triptych.kube import names
from triptych.operator.api import MLLMDeploymentSpec
from triptych.operator.objmeta import Obj, Owner, common_labels, object_meta, router_selector
from triptych.operator.podspec import (
    ADMIN_TOKEN_ENV,
    INTERNAL_TOKEN_ENV,
    add_model,
    base_env,
    http_probe,
    model_dir,
    pod_security_context,
    resources,
    security_context,
    shared_volumes,
    token_env,
    tolerations,
)

# What the router's discovery (router/k8s_discovery.py) does: list and watch pods in its own
# namespace. A namespaced Role per deployment, not a ClusterRole: no install mode needs
# cluster-scoped RBAC for the router, and the operator may create it because it holds
# these verbs itself (RBAC's escalation check).
ROUTER_RULES: list[Obj] = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]


def router_rbac(owner: Owner) -> list[Obj]:
    name = names.router_name(owner.name)
    account = {"apiVersion": "v1", "kind": "ServiceAccount",
               "metadata": object_meta(owner, name, names.COMPONENT_ROUTER)}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": object_meta(owner, name, names.COMPONENT_ROUTER),
            "rules": [dict(rule) for rule in ROUTER_RULES]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": object_meta(owner, name, names.COMPONENT_ROUTER),
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
               "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}]}
    return [account, role, binding]


def router_args(owner: Owner, spec: MLLMDeploymentSpec) -> list[str]:
    args = ["--model", model_dir(spec.model.source), "--host", "0.0.0.0", "--port", str(spec.router.port),
            "--served-model-name", spec.model.served_model_name or owner.name,
            "--discovery", "kubernetes", "--k8s-namespace", owner.namespace, "--k8s-deployment", owner.name,
            # The router does not read the serving config: its SLO metrics and context limit come as flags.
            "--ttft-slo", f"{spec.slo.ttft_ms / 1000:g}", "--tbt-slo", f"{spec.slo.tbt_ms / 1000:g}",
            "--slo-attainment-target", f"{spec.slo.attainment_target:g}"]
    if spec.model.max_model_len is not None:
        args += ["--max-model-len", str(spec.model.max_model_len)]
    if spec.router.api_keys_secret_ref is not None:
        args += ["--api-key-file", f"{names.SECRETS_MOUNT}/api-keys"]
    return args


def router_deployment(owner: Owner, spec: MLLMDeploymentSpec) -> Obj:
    router = spec.router
    volumes, mounts = shared_volumes(owner, None)
    init = add_model(spec, router.image, router.image_pull_policy, volumes, mounts)
    if router.api_keys_secret_ref is not None:
        ref = router.api_keys_secret_ref
        volumes.append({"name": "api-keys", "secret": {"secretName": ref.name,
                                                       "items": [{"key": ref.key, "path": "api-keys"}]}})
        mounts.append({"name": "api-keys", "mountPath": names.SECRETS_MOUNT, "readOnly": True})
    container = {
        "name": "router", "image": router.image, "imagePullPolicy": router.image_pull_policy,
        "command": ["triptych", "router"], "args": router_args(owner, spec),
        "ports": [{"name": names.PORT_NAME, "containerPort": router.port, "protocol": "TCP"}],
        # The internal token for /internal/* calls to workers; the admin token so its holder
        # (and the router's own admin views) can be checked.
        "env": [*base_env(), *token_env(owner, INTERNAL_TOKEN_ENV, ADMIN_TOKEN_ENV)],
        "resources": resources(router.resources),
        "securityContext": security_context(),
        "volumeMounts": mounts,
        "startupProbe": http_probe("/live", 5, 60),
        "readinessProbe": http_probe("/ready", 5, 3),
        "livenessProbe": http_probe("/live", 10, 6),
    }
    pod_spec: Obj = {
        "serviceAccountName": names.router_name(owner.name),  # pod watch for discovery
        "enableServiceLinks": False,
        "securityContext": pod_security_context(),
        "containers": [container],
        "volumes": volumes,
    }
    if init:
        pod_spec["initContainers"] = init
    if router.node_selector:
        pod_spec["nodeSelector"] = dict(sorted(router.node_selector.items()))
    if router.tolerations:
        pod_spec["tolerations"] = tolerations(router.tolerations)
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": object_meta(owner, names.router_name(owner.name), names.COMPONENT_ROUTER),
        "spec": {
            "replicas": router.replicas,
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": router_selector(owner)},
            "template": {"metadata": {"labels": common_labels(owner, names.COMPONENT_ROUTER)},
                         "spec": pod_spec},
        },
    }


def router_service(owner: Owner, spec: MLLMDeploymentSpec) -> Obj:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": object_meta(owner, names.router_name(owner.name), names.COMPONENT_ROUTER),
            "spec": {"type": spec.router.service_type, "selector": router_selector(owner),
                     "ports": [{"name": names.PORT_NAME, "port": spec.router.port, "targetPort": names.PORT_NAME,
                                "protocol": "TCP"}]}}
