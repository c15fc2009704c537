"""The whole install path on a real cluster, in order: install the chart, apply the tiny example,
wait for Ready, chat through the router Service (with an image), scale an instance type, switch
a role in place, delete the deployment and check nothing it owned is left, uninstall."""

from __future__ import annotations

import base64
import io
import os
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml
from e2ekit import CHART, ROOT, Cluster
from PIL import Image

pytestmark = pytest.mark.e2e

WORKER_IMAGE = os.environ.get("TRIPTYCH_E2E_WORKER_IMAGE", "ghcr.io/triptych/worker:0.1.0")
OPERATOR_IMAGE = os.environ.get("TRIPTYCH_E2E_OPERATOR_IMAGE", "ghcr.io/triptych/operator:0.1.0")
EXAMPLE = os.environ.get("TRIPTYCH_E2E_EXAMPLE", str(ROOT / "examples" / "tiny-cpu.yaml"))
READY_TIMEOUT = float(os.environ.get("TRIPTYCH_E2E_READY_TIMEOUT", "900"))
RELEASE = "triptych-e2e"
OPERATOR_NS = "triptych-system"
# Kinds the operator creates for a deployment, all labelled triptych.dev/deployment=<name>.
CHILD_KINDS = "deployments,replicasets,pods,services,configmaps,secrets,serviceaccounts,rolebindings," \
              "poddisruptionbudgets,networkpolicies"


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    return Cluster(os.environ["TRIPTYCH_E2E_KUBECONFIG"])


@pytest.fixture(scope="module")
def namespace(cluster: Cluster) -> Iterator[str]:
    name = os.environ.get("TRIPTYCH_E2E_NAMESPACE") or f"triptych-e2e-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name, check=False)
    yield name
    if not os.environ.get("TRIPTYCH_E2E_NAMESPACE"):
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def chart(cluster: Cluster) -> Iterator[None]:
    repo, _, tag = OPERATOR_IMAGE.rpartition(":")
    cluster.helm("upgrade", "--install", RELEASE, str(CHART), "--namespace", OPERATOR_NS, "--create-namespace",
                 "--set", f"image.repository={repo}", "--set", f"image.tag={tag}",
                 "--set", "image.pullPolicy=IfNotPresent", "--wait", "--timeout", "5m", timeout=400)
    yield
    cluster.helm("uninstall", RELEASE, "--namespace", OPERATOR_NS, "--wait", timeout=300, check=False)


def _example(namespace: str) -> dict[str, Any]:
    doc = yaml.safe_load(open(EXAMPLE).read())
    doc["metadata"]["namespace"] = namespace
    spec = doc["spec"]
    for pool in spec.get("pools") or [{"name": "workers"}]:
        pool["image"] = WORKER_IMAGE
    spec.setdefault("pools", [{"name": "workers", "image": WORKER_IMAGE}])
    spec.setdefault("router", {})["image"] = WORKER_IMAGE
    return doc


@pytest.fixture(scope="module")
def deployment(cluster: Cluster, chart: None, namespace: str) -> Iterator[dict[str, Any]]:
    doc = _example(namespace)
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    yield doc
    cluster.kubectl("delete", "-f", "-", "--ignore-not-found", "--wait=true", input=yaml.safe_dump(doc),
                    check=False, timeout=300)


def _status(cluster: Cluster, doc: dict[str, Any]) -> dict[str, Any]:
    return cluster.get("mllm", doc["metadata"]["name"], "-n", doc["metadata"]["namespace"]).get("status") or {}


def _ready(cluster: Cluster, doc: dict[str, Any], topology: dict[str, int]) -> dict[str, Any] | None:
    status = _status(cluster, doc)
    ready = next((c for c in status.get("conditions", []) if c["type"] == "Ready"), {})
    types = {t: v["ready"] for t, v in status.get("instanceTypes", {}).items()}
    return status if ready.get("status") == "True" and all(types.get(t) == n for t, n in topology.items()) else None


def _image_url() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (220, 120, 10)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _chat(cluster: Cluster, doc: dict[str, Any]) -> dict[str, Any]:
    name, ns = doc["metadata"]["name"], doc["metadata"]["namespace"]
    port = (doc["spec"].get("router") or {}).get("port", 8000)
    with cluster.port_forward(ns, f"svc/{name}-router", port) as url:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        r = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
            "model": model, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": _image_url()}},
                {"type": "text", "text": "Describe the picture."}]}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"]
    return body


def _worker_roles(cluster: Cluster, doc: dict[str, Any]) -> dict[str, str]:
    pods = cluster.get("pods", "-n", doc["metadata"]["namespace"], "-l",
                       f"triptych.dev/deployment={doc['metadata']['name']},app.kubernetes.io/component=worker")
    return {p["metadata"]["name"]: p["metadata"]["labels"].get("triptych.dev/role", "")
            for p in pods["items"] if not p["metadata"].get("deletionTimestamp")}


def test_example_becomes_ready(cluster: Cluster, deployment: dict[str, Any]) -> None:
    topology = deployment["spec"]["topology"]
    status = cluster.wait_for("Ready", lambda: _ready(cluster, deployment, topology), READY_TIMEOUT)
    assert sorted(_worker_roles(cluster, deployment).values()) == sorted(
        t for t, n in topology.items() for _ in range(n))
    assert status["observedGeneration"] >= 1


def test_chat_with_an_image_through_the_router_service(cluster: Cluster, deployment: dict[str, Any]) -> None:
    body = _chat(cluster, deployment)
    assert body["usage"]["prompt_tokens"] > 16  # the image's visual tokens are in the prompt


def test_scale_an_instance_type(cluster: Cluster, deployment: dict[str, Any]) -> None:
    topology = {**deployment["spec"]["topology"]}
    kind = "D" if "D" in topology else next(iter(topology))
    topology[kind] += 1
    cluster.kubectl("patch", "mllm", deployment["metadata"]["name"], "-n", deployment["metadata"]["namespace"],
                    "--type", "merge", "-p", yaml.safe_dump({"spec": {"topology": topology}}, default_flow_style=True))
    cluster.wait_for(f"{kind} x{topology[kind]}", lambda: _ready(cluster, deployment, topology), READY_TIMEOUT)
    deployment["spec"]["topology"] = topology
    _chat(cluster, deployment)


def test_switch_a_role_in_place(cluster: Cluster, deployment: dict[str, Any]) -> None:
    """Move one instance from the most numerous type to another: the same pods serve afterwards,
    one of them relabelled (offload -> migrate -> onload), no pod replaced."""
    before = _worker_roles(cluster, deployment)
    topology = {**deployment["spec"]["topology"]}
    source = max(topology, key=lambda t: topology[t])
    target = next(t for t in ("P", "E", "D", "PD", "EP") if t in topology and t != source)
    topology[source] -= 1
    topology[target] += 1
    cluster.kubectl("patch", "mllm", deployment["metadata"]["name"], "-n", deployment["metadata"]["namespace"],
                    "--type", "merge", "-p", yaml.safe_dump({"spec": {"topology": topology}}, default_flow_style=True))
    cluster.wait_for("the switch", lambda: _ready(cluster, deployment, topology), READY_TIMEOUT)
    after = _worker_roles(cluster, deployment)
    assert set(after) == set(before), "a role switch must not replace pods"
    switched = [p for p in after if after[p] != before[p]]
    assert [(before[p], after[p]) for p in switched] == [(source, target)]
    deployment["spec"]["topology"] = topology
    _chat(cluster, deployment)


def test_delete_leaves_nothing(cluster: Cluster, deployment: dict[str, Any]) -> None:
    name, ns = deployment["metadata"]["name"], deployment["metadata"]["namespace"]
    cluster.kubectl("delete", "mllm", name, "-n", ns, "--wait=true", timeout=300)

    def gone() -> bool:
        left = cluster.get(CHILD_KINDS, "-n", ns, "-l", f"triptych.dev/deployment={name}")["items"]
        return not left

    cluster.wait_for("every child object to be deleted", gone, 300)
    assert cluster.kubectl("get", "mllm", name, "-n", ns, check=False).returncode != 0
