"""Step times for the operator's replans (`spec.autoscaling.replanProfile`): a ConfigMap in
the deployment's namespace holding a profile measured by `triptych profile` on the serving
GPUs, or the checkpoint's config.json for HydraInfer Table 2's roofline on a named GPU.

The operator does not hold the checkpoint (it is on the workers' volume), so the model's
shape comes from the ConfigMap too. The ConfigMap is read with `list` and a field selector
on its name: the verb reconcile already holds on ConfigMaps, so enabling replans needs no
new RBAC.
"""

from __future__ import annotations

import json

from pydantic import ValidationError

from triptych.kube.client import CONFIG_MAP, KubeClient
from triptych.operator.api import ReplanProfileSource
from triptych.operator.planner.model_shape import ModelShapeError, shape_of
from triptych.operator.planner.profile import StepProfile
from triptych.operator.planner.replanner import WindowReplanner
from triptych.operator.planner.roofline import roofline_profile
from triptych.operator.planner.simulator import SimConfig


class ProfileSourceError(RuntimeError):
    """The replan profile cannot be read; the message says what is missing or wrong."""


def profile_from(data: dict[str, str], source: ReplanProfileSource, where: str) -> StepProfile:
    """The measured profile under `profileKey`, else the roofline of `gpu` on the shape
    under `configKey` (with `preprocessorKey`'s image patching, when present)."""
    if source.profile_key in data:
        try:
            return StepProfile.model_validate_json(data[source.profile_key])
        except ValidationError as exc:
            raise ProfileSourceError(f"{where}[{source.profile_key}] is not a step-time profile "
                                     f"(triptych profile --out): {exc.errors()[0]['msg']}") from None
    if source.gpu is None:
        raise ProfileSourceError(f"{where} has no key {source.profile_key!r} (a measured profile), and no gpu "
                                 "is set for a roofline")
    if source.config_key not in data:
        raise ProfileSourceError(f"{where} has neither {source.profile_key!r} nor {source.config_key!r} (the "
                                 f"model's config.json, for the {source.gpu} roofline)")
    try:
        pre = json.loads(data[source.preprocessor_key]) if source.preprocessor_key in data else {}
        shape = shape_of(json.loads(data[source.config_key]), pre, where=f"{where}[{source.config_key}]")
    except json.JSONDecodeError as exc:
        raise ProfileSourceError(f"{where}: {exc}") from None
    except ModelShapeError as exc:  # it names the key
        raise ProfileSourceError(str(exc)) from None
    return roofline_profile(shape, source.gpu)


async def load_replanner(kube: KubeClient, namespace: str, source: ReplanProfileSource,
                         ttft_slo_s: float, tbt_slo_s: float) -> WindowReplanner:
    where = f"ConfigMap {namespace}/{source.config_map}"
    found = await kube.list(CONFIG_MAP, namespace, {}, name=source.config_map)
    if not found:
        raise ProfileSourceError(f"{where} not found")
    profile = profile_from(found[0].get("data") or {}, source, where)
    return WindowReplanner(profile, SimConfig(ttft_slo_s=ttft_slo_s, tbt_slo_s=tbt_slo_s))
