"""Kubernetes contracts shared by the operator, the router's discovery and the tests:
`names` (API coordinates, labels, annotations, child-object names) and `client` (the one
API client, from credentials to list/watch/apply). No torch, no kopf."""
