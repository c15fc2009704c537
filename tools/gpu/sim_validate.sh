#!/bin/bash
# The planner's simulator against measured runs on the GPU machine's CPU (16 dedicated cores,
# cgroup v2): a quiet host, where the 2-core VM's noise does not swamp the comparison.
# One topology's table goes to stderr (and $OUT/sv.json) as soon as it is measured.
#   device run: bash tools/gpu/sim_validate.sh [TOPOLOGIES] [REPEATS]   (carry .gpu/serve)
# On 2026-11-28 a fresh profile, two EPD deployments and one 1EP1D took 470 s there, so the
# three topologies at one deployment each should fit a call; two each do not.
set -u
. tools/gpu/setup.sh .gpu/serve || exit 1
nproc; uptime
timeout 540 python3 -m triptych.cli bench simulate-validate --model tiny --topologies "${1:-EPD,1EP1D,1E1P1D}" \
  --rates 1.5 4 --num-requests 24 --instance-cpus 0.25 --priority 16 --repeats "${2:-1}" \
  --save-profile "$OUT/profile.json" --out-json "$OUT/sv.json" 2>&1 | tee "$OUT/sv.log" | tail -40
uptime
