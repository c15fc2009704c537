"""End-to-end tests against a real Kubernetes cluster (kind with the CPU image, or a GPU cluster
with the CUDA image). Collected everywhere; skipped unless TRIPTYCH_E2E_KUBECONFIG names a
kubeconfig. docs/install.md has the exact commands. Settings (environment):

  TRIPTYCH_E2E_KUBECONFIG       kubeconfig of the cluster (required)
  TRIPTYCH_E2E_WORKER_IMAGE     worker image the example runs (default ghcr.io/triptych/worker:0.1.0)
  TRIPTYCH_E2E_OPERATOR_IMAGE   operator image the chart runs (default ghcr.io/triptych/operator:0.1.0)
  TRIPTYCH_E2E_EXAMPLE          MLLMDeployment to apply (default examples/tiny-cpu.yaml)
  TRIPTYCH_E2E_NAMESPACE        namespace for the example (default: a fresh triptych-e2e-XXXX)
  TRIPTYCH_E2E_READY_TIMEOUT    seconds to wait for Ready (default 900)
"""

from __future__ import annotations

import os

import pytest

REASON = "needs a cluster: set TRIPTYCH_E2E_KUBECONFIG (see docs/install.md, 'End-to-end tests')"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("TRIPTYCH_E2E_KUBECONFIG"):
        return
    for item in items:
        if "e2e" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=REASON))
