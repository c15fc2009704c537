#!/bin/bash
# The wheels a lent GPU machine lacks (it has PyTorch, transformers, numpy, pillow, pytest,
# httpx, ... but no network): downloaded here for its Python 3.12 and split into two sets
# that each fit one call's 64 MiB carry. Run in the checkout root; both folders are ignored.
#
#   tools/gpu/wheels.sh          # -> .gpu/video (PyAV, PyNvVideoCodec) and .gpu/serve (NIXL, transformers)
set -euo pipefail
PLATFORMS=""
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  PLATFORMS="$PLATFORMS --platform ${p}_x86_64"
done
get() {  # get DIR SPEC...
  local dir=$1; shift
  mkdir -p "$dir"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $PLATFORMS --platform any -d "$dir" "$@"
}
BASE=(pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
      fastapi==0.163.2 starlette==1.10.0 uvicorn==0.54.0 msgspec==0.22.0 llguidance==1.9.1
      opentelemetry-api==1.45.2 pytest-asyncio==1.5.0)
get .gpu/video "${BASE[@]}" av==18.1.0 pynvvideocodec==2.2.4
get .gpu/serve "${BASE[@]}" nixl==1.5.1 nixl-cu13==1.5.1 transformers==5.23.0
# Drop what no check here uses, so each set travels: PyNvVideoCodec's FFmpeg source tarball
# and notebooks, NIXL's expert-parallel torch extensions (28 MB, three torch versions).
python3 - <<'PY'
import glob, os, zipfile
def slim(src, drop):
    tmp = src + ".slim"
    with zipfile.ZipFile(src) as zi, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zo:
        for info in zi.infolist():
            if info.filename.startswith(drop):
                continue
            data = zi.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                data = "".join(line + "\n" for line in data.decode().splitlines() if not line.startswith(drop)).encode()
            zo.writestr(info, data)
    os.replace(tmp, src)
slim(glob.glob(".gpu/video/pynvvideocodec-*.whl")[0], ("pynvvideocodec-2.2.4.data/data/external", "samples/"))
slim(glob.glob(".gpu/serve/nixl_cu13-*.whl")[0], ("nixl_ep_cu13/",))
PY
du -sh .gpu/video .gpu/serve
