"""The kopf operator: MLLMDeployment -> Kubernetes objects (desired.py), one reconcile pass
per event (reconcile.py) and role assignment for worker pods (roles.py)."""
