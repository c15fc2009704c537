"""The tiny checkpoints: real layouts that transformers loads and generates from, offline."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from hf_reference import hf_generate, hf_next_token_logits, hf_processor, make_test_image

from triptych.cli import main as cli
from triptych.tiny_model import FAMILIES, LLAVA_CHAT_TEMPLATE, QWEN2_VL_CHAT_TEMPLATE, make_tiny_model

PROMPTS = ["Describe this image.", "What is shown in the picture? How many people are there?",
           "Hello", "Once upon a time there was"]


def _messages(text: str, num_images: int) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * num_images + [{"type": "text", "text": text}]}]


def test_layout_and_token_ids(tiny_model_dir: Path) -> None:
    names = {p.name for p in tiny_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "preprocessor_config.json", "generation_config.json", "chat_template.jinja"} <= names
    config = json.loads((tiny_model_dir / "config.json").read_text())
    tok = hf_processor(str(tiny_model_dir)).tokenizer
    text = config["text_config"]
    assert text["num_key_value_heads"] < text["num_attention_heads"]  # GQA
    assert text["vocab_size"] == len(tok)
    if config["model_type"] == "llava":
        assert config["image_token_index"] == tok.convert_tokens_to_ids("<image>")
        assert config["vision_feature_layer"] == -2
        assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
        assert tok("hi")["input_ids"][0] == 1  # Llama-style: <s> prepended
    else:
        assert config["image_token_id"] == tok.convert_tokens_to_ids("<|image_pad|>")
        assert config["video_token_id"] == tok.convert_tokens_to_ids("<|video_pad|>")
        assert config["vision_start_token_id"] == tok.convert_tokens_to_ids("<|vision_start|>")
        assert text["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
        gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
        assert gen["eos_token_id"] == [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]


def test_real_chat_templates(qwen2_vl_dir: Path, llava_dir: Path) -> None:
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi?"}, {"type": "image"}]}]
    qwen = hf_processor(str(qwen2_vl_dir))
    assert qwen.chat_template == QWEN2_VL_CHAT_TEMPLATE
    assert qwen.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|>Hi?<|vision_start|><|image_pad|><|vision_end|>"
        "<|im_end|>\n<|im_start|>assistant\n")
    with_ids = qwen.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, add_vision_id=True)
    assert "Picture 1: <|vision_start|>" in with_ids and "Picture 2: " in with_ids
    llava = hf_processor(str(llava_dir))
    assert llava.chat_template == LLAVA_CHAT_TEMPLATE
    assert llava.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        "USER: <image>\n<image>\nHi? ASSISTANT:")


def test_generate_with_images_is_not_degenerate(tiny_model_dir: Path) -> None:
    margins = []
    for i, prompt in enumerate(PROMPTS):
        images = [make_test_image(i, 112, 84)] * (i % 3)
        out = hf_generate(tiny_model_dir, _messages(prompt, len(images)), images, max_new_tokens=24)
        assert len(out) == 24  # random weights: EOS this early would be a fluke
        assert len(set(out)) >= 8, out  # not stuck on one token
        logits = hf_next_token_logits(tiny_model_dir, _messages(prompt, len(images)), images)
        top2 = logits.topk(2).values
        margins.append(float(top2[0] - top2[1]))
    # Default HF init (std 0.02) gives margins ~1e-3; ours are ~0.5 (lm head std 4/sqrt(d)).
    assert statistics.median(margins) > 0.1, margins


def test_images_change_the_output(qwen25_vl_dir: Path) -> None:
    msgs = _messages("Describe this image.", 1)
    a = hf_generate(qwen25_vl_dir, msgs, [make_test_image(1, 112, 84)], max_new_tokens=8)
    b = hf_generate(qwen25_vl_dir, msgs, [make_test_image(2, 112, 84)], max_new_tokens=8)
    assert a != b


def test_deterministic_by_seed(tmp_path: Path) -> None:
    def weights(seed: int, name: str) -> bytes:
        return (make_tiny_model("qwen2-vl", tmp_path / name, seed=seed) / "model.safetensors").read_bytes()

    assert weights(0, "a") == weights(0, "b")
    assert weights(0, "a") != weights(1, "c")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "c" / "tokenizer.json").read_bytes()


def test_cli_and_small_size(tmp_path: Path) -> None:
    from safetensors import safe_open

    assert cli(["make-tiny-model", "--family", "llava", "--out", str(tmp_path / "m"), "--size", "small"]) == 0
    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as f:
        params = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
    assert 10e6 < params < 80e6
    assert json.loads((tmp_path / "m" / "config.json").read_text())["text_config"]["hidden_size"] == 512


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_unknown_family_and_size(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown family"):
        make_tiny_model("gpt2", tmp_path)
    with pytest.raises(ValueError, match="unknown size"):
        make_tiny_model("llava", tmp_path, size="huge")


def test_tiny_model_path_concurrent_builders(tmp_path: Path) -> None:
    """Two processes race to build the same checkpoint: both see the same complete dir."""
    code = ("import sys; from triptych.tiny_model import tiny_model_path; "
            "print(tiny_model_path('qwen2.5-vl', seed=7))")
    env = {**os.environ, "TRIPTYCH_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(outs)) == 1
    built = Path(outs[0])
    assert built == tmp_path / "models" / "qwen2.5-vl-tiny-s7"
    assert (built / "model.safetensors").exists() and (built / "triptych_tiny.json").exists()
    leftovers = [p.name for p in (tmp_path / "models").iterdir() if ".build." in p.name or ".stale." in p.name]
    assert leftovers == []


def test_families_constant_matches_cli() -> None:
    from triptych.cli import FAMILIES as CLI_FAMILIES

    assert tuple(CLI_FAMILIES) == FAMILIES
