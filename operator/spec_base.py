"""The base model and Kubernetes field types the MLLMDeployment spec modules share
(api.py, pool_spec.py): camelCase on the wire, unknown fields rejected, quantities and
pass-through objects as the CRD schema needs them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

PullPolicy = Literal["Always", "IfNotPresent", "Never"]

# A Kubernetes resource quantity ("4Gi", "500m", 2): int-or-string in the schema.
Quantity = Annotated[int | str, Field(json_schema_extra={"x-kubernetes-int-or-string": True})]
# A Kubernetes object we pass through unchanged (affinity, volume sources, peers...):
# the API server keeps its fields and kubernetes-validate checks them in the rendered pod.
Opaque = Annotated[dict[str, Any], Field(json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})]
DNS_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


class Model(BaseModel):
    """Base: camelCase on the wire, unknown fields rejected (typos are errors, not no-ops)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class ResourceRequirements(Model):
    requests: dict[str, Quantity] = Field(default_factory=dict)
    limits: dict[str, Quantity] = Field(default_factory=dict)


class Toleration(Model):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None
