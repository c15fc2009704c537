"""Save a Qwen2-VL checkpoint's language model as a plain `Qwen2ForCausalLM` (same weights,
same tokenizer), for servers that take text-only models (vLLM CPU: its Qwen2-VL needs
torchvision). For text, Qwen's M-RoPE positions are equal on all axes, i.e. plain RoPE,
so greedy outputs are the same tokens.

    python tools/save_text_lm.py SRC_VL_DIR DST_DIR
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from triptych.bench.engine import hf_model, hf_text_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def main(src: str, dst: str) -> None:
    out = Path(dst)
    lm = hf_text_model(hf_model(Path(src)))
    lm.config.architectures = ["Qwen2ForCausalLM"]
    lm.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copy(Path(src) / name, out / name)
    print(out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
