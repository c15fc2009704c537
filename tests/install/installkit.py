"""Helpers for the install tests: where the optional tools are (tools/install-test-deps.sh
installs them; each test skips with a reason when its tool is missing)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

CACHE = Path(os.environ.get("TRIPTYCH_TOOLS_CACHE", Path.home() / ".cache" / "triptych"))


def find_helm() -> str | None:
    """$TRIPTYCH_HELM, else helm on PATH, else the one tools/fetch_helm.py put in the cache."""
    for candidate in (os.environ.get("TRIPTYCH_HELM"), shutil.which("helm"), str(CACHE / "bin" / "helm")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None
