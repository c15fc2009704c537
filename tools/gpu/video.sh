#!/bin/bash
# NVDEC on the GPU machine: the gpu-marked video tests, then NVDEC against PyAV on one clip.
#   device run: bash tools/gpu/video.sh   (carry .gpu/video)
set -u
. tools/gpu/setup.sh .gpu/video || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
ldconfig -p | grep -i nvcuvid
timeout 240 python3 -m pytest -q -p no:cacheprovider -rs -m gpu \
  tests/worker/test_video_decode.py tests/worker/test_video_instance.py 2>&1 | tee "$OUT/pytest_gpu_video.log" | tail -5
timeout 200 python3 tools/gpu/nvdec_bench.py 2>&1 | tee "$OUT/nvdec_bench.txt"
