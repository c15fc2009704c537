"""The kopf operator: MLLMDeployment -> Kubernetes objects; planner and autoscaler."""
