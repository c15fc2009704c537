"""The internal plane's tokens: one Secret `<m>-tokens` per MLLMDeployment.

Created once, with random tokens, the first time a valid spec is reconciled; never
rewritten by a pass (a new token would lock out every pod that read the old one at start),
owned by the MLLMDeployment so the garbage collector removes it with it. Pods read the
tokens through `env.valueFrom.secretKeyRef` (podspec.token_env), never from args or the CR.
The operator reads the admin token from it to call a worker's /admin/role. Deleting the
Secret by hand makes the next pass create new tokens: restart the pods afterwards.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Mapping
from typing import Any

from triptych.kube import names
from triptych.kube.client import SECRET, KubeClient
from triptych.operator.objmeta import Obj, Owner, common_labels

TOKEN_BYTES = 32


def _b64(value: str) -> str:
    return base64.b64encode(value.encode()).decode()


def tokens_secret(owner: Owner, internal: str, admin: str) -> Obj:
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": names.tokens_secret_name(owner.name), "namespace": owner.namespace,
                         "labels": common_labels(owner, "tokens"),
                         "ownerReferences": [{"apiVersion": names.API_VERSION, "kind": names.KIND,
                                              "name": owner.name, "uid": owner.uid, "controller": True}]},
            "data": {names.SECRET_KEY_INTERNAL_TOKEN: _b64(internal), names.SECRET_KEY_ADMIN_TOKEN: _b64(admin)}}


def secret_value(secret: Mapping[str, Any], key: str) -> str | None:
    raw = (secret.get("data") or {}).get(key)
    return base64.b64decode(raw).decode() if raw else None


async def ensure_tokens(kube: KubeClient, owner: Owner) -> tuple[str | None, bool]:
    """The admin token (None if the Secret lacks it) and whether the Secret was created now."""
    name = names.tokens_secret_name(owner.name)
    secret = await kube.get(SECRET, owner.namespace, name)
    created = False
    if secret is None:
        fresh = tokens_secret(owner, secrets.token_urlsafe(TOKEN_BYTES), secrets.token_urlsafe(TOKEN_BYTES))
        made = await kube.create(SECRET, fresh)
        created = made is not None
        # 409: a concurrent creator won (e.g. a peer that just took over): use its tokens.
        secret = fresh if made is not None else await kube.get(SECRET, owner.namespace, name)
    return (secret_value(secret, names.SECRET_KEY_ADMIN_TOKEN) if secret else None), created
