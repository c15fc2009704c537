#!/bin/bash
# The shared-GPU layout under NVIDIA MPS on the GPU machine (tools/gpu/mps_serve.py).
#   device run: bash tools/gpu/mps.sh   (carry .gpu/serve)
set -u
. tools/gpu/setup.sh .gpu/serve || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv
timeout 420 python3 tools/gpu/mps_serve.py 2>&1 | tee "$OUT/mps_serve.log"
