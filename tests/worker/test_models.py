"""The worker's model layer against transformers: spec reading, role-scoped loading,
M-RoPE positions, vision encoders, and logits of our paged-KV language model in one-shot,
chunked and decode steps (fp32, block sizes 16 and 1, shuffled block tables)."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from float_bounds import assert_close_fp32
from hf_reference import hf_inputs, hf_model, make_test_image
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from triptych.tiny_model import tiny_model_path as tiny_dir  # TRIPTYCH_CACHE: tests/conftest.py
from triptych.worker.attention import build_metadata
from triptych.worker.models import (
    LanguageModel,
    LoadedModel,
    UnsupportedCheckpointError,
    canonical_key,
    decode_positions,
    load_model,
    prompt_positions,
    read_spec,
)

FAMILIES = ("qwen2-vl", "qwen2.5-vl", "llava")


@dataclass
class Span:
    """A multimodal placeholder run (the fields of triptych.processor.MMItem we use)."""

    kind: str
    offset: int
    length: int
    grid_thw: tuple[int, int, int] | None
    second_per_grid_t: float = 1.0


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def loaded(family: str) -> LoadedModel:
    return load_model(tiny_dir(family), vision=True, language=True)


# --- prompts ----------------------------------------------------------------------------------


@dataclass
class Prompt:
    hf: dict  # the HF processor's output (input_ids, pixel values, ...)
    ids: torch.Tensor  # [L]
    embeds: torch.Tensor  # [L, H], image rows from our VisionModel
    positions: torch.Tensor  # [L] or [3, L]
    delta: int


PROMPTS = [
    ("Describe this image and compare it.", [(1, 100, 70), (2, 60, 90)]),
    ("What is shown?", [(3, 84, 84)]),
    ("Hello there, how are you today? Tell me a story about a fox.", []),
]


def _messages(text: str, num_images: int) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * num_images + [{"type": "text", "text": text}]}]


def _spans(ids: torch.Tensor, token: int, grids: list) -> list[Span]:
    spans, i, mask = [], 0, (ids == token).tolist()
    while i < len(mask):
        if mask[i]:
            j = i
            while j < len(mask) and mask[j]:
                j += 1
            spans.append(Span("image", i, j - i, grids[len(spans)]))
            i = j
        else:
            i += 1
    return spans


def make_prompt(model: LoadedModel, family: str, index: int) -> Prompt:
    text, image_args = PROMPTS[index]
    images = [make_test_image(*args) for args in image_args]
    inputs = hf_inputs(str(tiny_dir(family)), _messages(text, len(images)), images)
    ids = inputs["input_ids"][0]
    assert model.vision is not None and model.language is not None
    with torch.inference_mode():
        vision_inputs = [model.vision.preprocess(image) for image in images]
        embeds = model.language.embed(ids).clone()
        mask = ids == model.spec.image_token_id
        if images:
            embeds[mask] = torch.cat(model.vision.encode(vision_inputs))
    spans = _spans(ids, model.spec.image_token_id, [v.grid_thw for v in vision_inputs])
    positions, delta = prompt_positions(model.spec, ids.tolist(), spans)
    return Prompt(inputs, ids, embeds, positions, delta)


def hf_logits(family: str, prompt: Prompt, extra: list[int]) -> torch.Tensor:
    """HF logits `[L + len(extra), V]` for the prompt followed by `extra` text tokens."""
    inputs = dict(prompt.hf)
    if extra:
        tail = torch.tensor([extra])
        inputs["input_ids"] = torch.cat([inputs["input_ids"], tail], dim=1)
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        if "mm_token_type_ids" in inputs:
            inputs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(tail)], 1)
    with torch.inference_mode():
        return hf_model(str(tiny_dir(family)))(**inputs).logits[0].float()


# --- running our model over a paged cache ------------------------------------------------------


class PagedRunner:
    """Sequences sharing one paged KV cache whose blocks are handed out in shuffled order."""

    def __init__(self, lm: LanguageModel, block_size: int, num_blocks: int = 512, seed: int = 0) -> None:
        self.lm, self.block_size = lm, block_size
        self.cache = lm.allocate_kv_cache(num_blocks, block_size)
        self.free = random.Random(seed).sample(range(num_blocks), num_blocks)
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def step(self, work: list[tuple[int, torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """`work` = [(seq, embeds [n, H], positions [n] / [3, n])]; returns each seq's logits [n, V]."""
        kv_lens = []
        for seq, embeds, _ in work:
            self.lengths[seq] = self.lengths.get(seq, 0) + embeds.shape[0]
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < self.lengths[seq]:
                table.append(self.free.pop())
            kv_lens.append(self.lengths[seq])
        sizes = [e.shape[0] for _, e, _ in work]
        meta = build_metadata(sizes, kv_lens, [self.tables[s] for s, _, _ in work], self.block_size)
        embeds = torch.cat([e for _, e, _ in work])
        positions = torch.cat([p for _, _, p in work], dim=-1)
        with torch.inference_mode():
            logits = self.lm.logits(self.lm(embeds, positions, self.cache, meta))
        return list(logits.split(sizes))


def _chunks(prompt: Prompt, bounds: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    edges = [0, *bounds, prompt.ids.shape[0]]
    return [(prompt.embeds[a:b], prompt.positions[..., a:b]) for a, b in zip(edges, edges[1:], strict=False)]


# --- exactness against transformers --------------------------------------------------------


@pytest.mark.parametrize("block_size", [16, 1])
def test_one_shot_prefill_matches_hf(loaded: LoadedModel, family: str, block_size: int) -> None:
    assert loaded.language is not None
    prompt = make_prompt(loaded, family, 0)
    runner = PagedRunner(loaded.language, block_size)
    (ours,) = runner.step([(0, prompt.embeds, prompt.positions)])
    reference = hf_logits(family, prompt, [])
    assert ours.shape == reference.shape
    assert_close_fp32(ours, reference)


@pytest.mark.parametrize("block_size", [16, 1])
def test_chunked_prefill_split_inside_image_matches_hf(
    loaded: LoadedModel, family: str, block_size: int
) -> None:
    assert loaded.language is not None
    prompt = make_prompt(loaded, family, 0)
    image = (prompt.ids == loaded.spec.image_token_id).nonzero().flatten().tolist()
    inside = image[len(image) // 2]  # a chunk boundary strictly inside the first image run
    assert image[0] < inside <= image[-1]
    runner = PagedRunner(loaded.language, block_size, seed=1)
    outs = [runner.step([(0, e, p)])[0] for e, p in _chunks(prompt, [3, inside, inside + 5])]
    reference = hf_logits(family, prompt, [])
    assert_close_fp32(torch.cat(outs), reference)


def test_decode_steps_batched_match_hf_and_single_sequence_runs(loaded: LoadedModel, family: str) -> None:
    """Three prompts of different lengths: prefilled in one mixed batch (one as two chunks
    interleaved with another's decode), then decoded together; every step's logits equal
    HF's on prompt + generated tokens, and equal the same sequence decoded alone."""
    assert loaded.language is not None
    prompts = [make_prompt(loaded, family, i) for i in range(3)]
    steps = 4
    batched = PagedRunner(loaded.language, 16, seed=2)
    split = prompts[0].ids.shape[0] // 2
    first = _chunks(prompts[0], [split])
    logits = {0: [], 1: [], 2: []}
    out = batched.step([(0, *first[0]), (1, prompts[1].embeds, prompts[1].positions)])
    logits[1].append(out[1][-1])
    tokens = {1: [int(out[1][-1].argmax())]}
    # seq 1 decodes while seq 0 finishes its prefill and seq 2 prefills in one chunk.
    work = [
        _decode_work(loaded, 1, prompts[1], tokens[1]),
        (0, *first[1]),
        (2, prompts[2].embeds, prompts[2].positions),
    ]
    out = batched.step(work)
    logits[1].append(out[0][-1])
    tokens[1].append(int(out[0][-1].argmax()))
    for seq, o in ((0, out[1]), (2, out[2])):
        logits[seq].append(o[-1])
        tokens[seq] = [int(o[-1].argmax())]
    for _ in range(steps):
        out = batched.step([_decode_work(loaded, s, prompts[s], tokens[s]) for s in (2, 0, 1)])
        for seq, o in zip((2, 0, 1), out, strict=True):
            logits[seq].append(o[-1])
            tokens[seq].append(int(o[-1].argmax()))
    for seq, prompt in enumerate(prompts):
        generated = tokens[seq][:-1]  # the last token was sampled but never fed back
        reference = hf_logits(family, prompt, generated)[prompt.ids.shape[0] - 1 :]
        ours = torch.stack(logits[seq])
        assert ours.shape == reference.shape
        assert_close_fp32(ours, reference, msg=f"sequence {seq}")
        alone = _decode_alone(loaded, prompt, generated)
        assert_close_fp32(ours, alone, msg=f"sequence {seq} batched vs alone")


def _decode_work(loaded: LoadedModel, seq: int, prompt: Prompt, tokens: list[int]) -> tuple:
    assert loaded.language is not None
    index = prompt.ids.shape[0] + len(tokens) - 1  # position index of the token being fed
    embeds = loaded.language.embed(torch.tensor(tokens[-1:]))
    return seq, embeds, decode_positions(loaded.spec, index, 1, prompt.delta)


def _decode_alone(loaded: LoadedModel, prompt: Prompt, generated: list[int]) -> torch.Tensor:
    assert loaded.language is not None
    runner = PagedRunner(loaded.language, 1, seed=7)
    outs = [runner.step([(0, prompt.embeds, prompt.positions)])[0][-1]]
    for i in range(len(generated)):
        outs.append(runner.step([_decode_work(loaded, 0, prompt, generated[: i + 1])])[0][-1])
    return torch.stack(outs)


# --- positions ---------------------------------------------------------------------------------


def test_prompt_positions_match_get_rope_index_for_images(loaded: LoadedModel, family: str) -> None:
    prompt = make_prompt(loaded, family, 0)
    if family == "llava":
        assert torch.equal(prompt.positions, torch.arange(prompt.ids.shape[0])) and prompt.delta == 0
        assert torch.equal(decode_positions(loaded.spec, 70, 2, 0), torch.tensor([70, 71]))
        return
    hf = hf_model(str(tiny_dir(family)))
    ref, ref_delta = hf.model.get_rope_index(
        prompt.hf["input_ids"], prompt.hf["mm_token_type_ids"], image_grid_thw=prompt.hf["image_grid_thw"]
    )
    assert torch.equal(prompt.positions, ref[:, 0]) and prompt.delta == int(ref_delta)
    assert prompt.delta < 0  # merged image grids take fewer positions than tokens
    assert decode_positions(loaded.spec, 70, 1, prompt.delta).tolist() == [[70 + prompt.delta]] * 3


@pytest.mark.parametrize("qwen", ["qwen2-vl", "qwen2.5-vl"])
def test_prompt_positions_video_and_mixed_items_match_get_rope_index(qwen: str) -> None:
    spec = read_spec(tiny_dir(qwen))
    hf = hf_model(str(tiny_dir(qwen)))
    # text(3) video 3x4x6 -> 3*2*3=18 tokens, text(2), image 1x6x4 -> 6 tokens, text(4)
    layout = [(0, 3), (2, 18), (0, 2), (1, 6), (0, 4)]
    types = torch.tensor([[t for t, n in layout for _ in range(n)]])
    token = {0: 5, 1: spec.image_token_id, 2: spec.video_token_id}
    ids = torch.tensor([[token[int(t)] for t in types[0]]])
    spans = [Span("video", 3, 18, (3, 4, 6), second_per_grid_t=1.5), Span("image", 23, 6, (1, 6, 4))]
    ours, delta = prompt_positions(spec, ids[0].tolist(), spans)
    kwargs = {"second_per_grid_ts": torch.tensor([1.5])} if qwen == "qwen2.5-vl" else {}
    ref, ref_delta = hf.model.get_rope_index(
        ids,
        types,
        image_grid_thw=torch.tensor([[1, 6, 4]]),
        video_grid_thw=torch.tensor([[3, 4, 6]]),
        **kwargs,
    )
    assert torch.equal(ours, ref[:, 0]) and delta == int(ref_delta)
    if qwen == "qwen2.5-vl":  # temporal ids spaced by tokens_per_second * seconds per grid
        assert ours[0, 3:21].unique().tolist() == [3, 6, 9]


def test_prompt_positions_reject_inconsistent_items() -> None:
    spec = read_spec(tiny_dir("qwen2-vl"))
    with pytest.raises(ValueError, match="placeholder run has 5"):
        prompt_positions(spec, [1] * 10, [Span("image", 2, 5, (1, 4, 4))])
    with pytest.raises(ValueError, match="runs past the prompt"):
        prompt_positions(spec, [1] * 10, [Span("image", 8, 4, (1, 4, 4))])
    with pytest.raises(ValueError, match="no grid_thw"):
        prompt_positions(spec, [1] * 10, [Span("image", 2, 4, None)])


# --- vision --------------------------------------------------------------------------------


def test_vision_encode_batches_across_images_like_hf(loaded: LoadedModel, family: str) -> None:
    assert loaded.vision is not None
    images = [make_test_image(5, 100, 70), make_test_image(6, 56, 56), make_test_image(7, 70, 112)]
    inputs = [loaded.vision.preprocess(image) for image in images]
    together = loaded.vision.encode(inputs)
    alone = [loaded.vision.encode([item])[0] for item in inputs]
    hf = hf_model(str(tiny_dir(family)))
    processed = hf_inputs(str(tiny_dir(family)), _messages("x", 3), images)
    with torch.inference_mode():
        if family == "llava":
            reference = hf.model.get_image_features(pixel_values=processed["pixel_values"]).pooler_output
        else:
            reference = hf.model.get_image_features(
                processed["pixel_values"], processed["image_grid_thw"]
            ).pooler_output
    for item, ours, single, ref in zip(inputs, together, alone, reference, strict=True):
        assert ours.shape == (item.num_tokens, loaded.spec.hidden_size) == tuple(ref.shape)
        assert_close_fp32(ours, single)
        assert_close_fp32(ours, ref)


# --- role-scoped loading ---------------------------------------------------------------------


def _module_types(module: nn.Module) -> set[str]:
    return {type(m).__module__ + "." + type(m).__name__ for m in module.modules()}


def test_encoder_only_load_has_no_llm_parameters(family: str) -> None:
    model = load_model(tiny_dir(family), vision=True, language=False)
    assert model.language is None and model.vision is not None
    names = [name for name, _ in model.vision.named_parameters()]
    assert names and all(
        n.split(".")[0] in {"visual", "vision_tower", "multi_modal_projector"} for n in names
    )
    assert not any(
        "embed_tokens" in n or "lm_head" in n or ".layers." in n and "encoder" not in n for n in names
    )
    vocab = model.spec.vocab_size
    assert all(vocab not in p.shape for p in model.vision.parameters())


def test_lm_only_load_has_no_vision_parameters_or_transformers_modules(family: str) -> None:
    model = load_model(tiny_dir(family), vision=False, language=True)
    assert model.vision is None and model.language is not None
    names = [name for name, _ in model.language.named_parameters()]
    assert names and not any(n.startswith(("visual", "vision_tower", "multi_modal_projector")) for n in names)
    assert all(n.split(".")[0] in {"embed_tokens", "layers", "norm", "lm_head"} for n in names)
    types = _module_types(model.language)
    assert not any(t.startswith("transformers.") for t in types), types
    from transformers import PreTrainedModel

    assert not any(isinstance(m, PreTrainedModel) for m in model.language.modules())
    assert all(p.device.type == "cpu" and not p.is_meta for p in model.language.parameters())
    assert not any(p.requires_grad for p in model.language.parameters())


def test_bf16_load_keeps_rope_in_float32() -> None:
    model = load_model(tiny_dir("qwen2-vl"), vision=True, language=True, dtype=torch.bfloat16)
    assert model.language is not None and model.vision is not None
    assert model.language.dtype == torch.bfloat16 and model.language.inv_freq.dtype == torch.float32
    assert model.vision.dtype == torch.bfloat16
    prompt = make_prompt(model, "qwen2-vl", 1)
    assert prompt.embeds.dtype == torch.bfloat16
    (logits,) = PagedRunner(model.language, 16).step([(0, prompt.embeds, prompt.positions)])
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


# --- checkpoint layouts and spec -------------------------------------------------------------


def test_canonical_key_layouts() -> None:
    cases = {
        "model.language_model.layers.0.self_attn.q_proj.weight": ("lm", "layers.0.self_attn.q_proj.weight"),
        "model.layers.3.mlp.up_proj.weight": ("lm", "layers.3.mlp.up_proj.weight"),
        "model.embed_tokens.weight": ("lm", "embed_tokens.weight"),
        "language_model.model.norm.weight": ("lm", "norm.weight"),
        "language_model.lm_head.weight": ("lm", "lm_head.weight"),
        "lm_head.weight": ("lm", "lm_head.weight"),
        "model.visual.blocks.0.attn.qkv.weight": ("vision", "visual.blocks.0.attn.qkv.weight"),
        "visual.merger.mlp.0.bias": ("vision", "visual.merger.mlp.0.bias"),
        "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight": (
            "vision",
            "vision_tower.encoder.layers.0.mlp.fc1.weight",
        ),
        "model.vision_tower.embeddings.class_embedding": (
            "vision",
            "vision_tower.embeddings.class_embedding",
        ),
        "model.multi_modal_projector.linear_1.weight": ("vision", "multi_modal_projector.linear_1.weight"),
    }
    for key, expected in cases.items():
        assert canonical_key(key) == expected, key
    assert canonical_key("something.else") is None


def _copy_checkpoint(src: Path, dst: Path, rename) -> Path:
    dst.mkdir()
    for path in src.iterdir():
        if path.suffix != ".safetensors" and path.is_file():
            shutil.copy(path, dst / path.name)
    with safe_open(str(src / "model.safetensors"), framework="pt") as handle:
        tensors = {rename(k): handle.get_tensor(k) for k in handle.keys()}
    save_file({k: v for k, v in tensors.items() if k is not None}, str(dst / "model.safetensors"))
    return dst


def _transformers5_name(family: str, key: str) -> str:
    """The in-memory (transformers 5) name of an on-disk key."""
    part, name = canonical_key(key) or ("", "")
    if part == "lm":
        return name if name.startswith("lm_head") else f"model.language_model.{name}"
    return f"model.{name}"


def test_transformers5_key_layout_loads_identically(tmp_path: Path, family: str, loaded: LoadedModel) -> None:
    src = tiny_dir(family)
    dst = _copy_checkpoint(src, tmp_path / "ckpt", lambda k: _transformers5_name(family, k))
    renamed = load_model(dst, vision=True, language=True)
    assert renamed.language is not None and loaded.language is not None
    for (name, ours), (_, ref) in zip(
        renamed.language.state_dict().items(), loaded.language.state_dict().items(), strict=True
    ):
        assert torch.equal(ours, ref), name
    assert renamed.vision is not None and loaded.vision is not None
    for (name, ours), (_, ref) in zip(
        renamed.vision.state_dict().items(), loaded.vision.state_dict().items(), strict=True
    ):
        assert torch.equal(ours, ref), name


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    dst = _copy_checkpoint(
        tiny_dir("qwen2-vl"),
        tmp_path / "ckpt",
        lambda k: None if k == "model.layers.1.mlp.up_proj.weight" else k,
    )
    with pytest.raises(UnsupportedCheckpointError, match=r"layers\.1\.mlp\.up_proj\.weight"):
        load_model(dst, vision=False, language=True)
    load_model(dst, vision=True, language=False)  # the encoder does not need that tensor


def test_read_spec_fields(family: str) -> None:
    spec = read_spec(tiny_dir(family))
    config = json.loads((tiny_dir(family) / "config.json").read_text())
    text = config["text_config"]
    assert (spec.num_layers, spec.hidden_size) == (text["num_hidden_layers"], text["hidden_size"])
    assert (spec.num_heads, spec.num_kv_heads) == (text["num_attention_heads"], text["num_key_value_heads"])
    assert spec.head_dim == text["hidden_size"] // text["num_attention_heads"]
    assert spec.vocab_size == text["vocab_size"]
    if family == "llava":
        assert spec.image_token_id == config["image_token_index"]
        assert (spec.uses_mrope, spec.text_arch, spec.qkv_bias, spec.video_token_id) == (
            False,
            "llama",
            False,
            None,
        )
        assert spec.eos_token_ids == (2,)
    else:
        assert spec.image_token_id == config["image_token_id"]
        assert spec.vision_start_token_id == config["vision_start_token_id"]
        assert (spec.uses_mrope, spec.text_arch, spec.qkv_bias, spec.spatial_merge_size) == (
            True,
            "qwen2",
            True,
            2,
        )
        assert spec.rope.mrope_section == tuple(text["rope_parameters"]["mrope_section"])
        generation = json.loads((tiny_dir(family) / "generation_config.json").read_text())
        assert set(spec.eos_token_ids) == set(generation["eos_token_id"])


def _write_config(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_read_spec_flat_qwen_config_equals_nested(tmp_path: Path) -> None:
    """Released Qwen2-VL configs keep the text fields at the top level."""
    nested = json.loads((tiny_dir("qwen2-vl") / "config.json").read_text())
    flat = {k: v for k, v in nested.items() if k != "text_config"}
    text = dict(nested["text_config"])
    text.pop("model_type", None)
    rope = text.pop("rope_parameters")
    flat.update(text)
    flat["rope_theta"] = rope["rope_theta"]
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    shutil.copy(tiny_dir("qwen2-vl") / "generation_config.json", tmp_path / "generation_config.json")
    assert read_spec(_write_config(tmp_path, flat)) == read_spec(tiny_dir("qwen2-vl"))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.update(model_type="mllama"), "model_type 'mllama' is not supported"),
        (lambda c: c.pop("model_type"), "missing field 'model_type'"),
        (lambda c: c["text_config"].update(model_type="gemma"), "text_config.model_type 'gemma'"),
        (
            lambda c: c["text_config"].update(
                rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}
            ),
            "rope_type 'yarn' is not supported",
        ),
    ],
)
def test_read_spec_rejects_unsupported(tmp_path: Path, edit, message: str) -> None:
    config = json.loads((tiny_dir("llava") / "config.json").read_text())
    edit(config)
    with pytest.raises(UnsupportedCheckpointError, match=message):
        read_spec(_write_config(tmp_path, config))


def test_read_spec_missing_config_and_weights(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedCheckpointError, match="no config.json"):
        read_spec(tmp_path)
    shutil.copy(tiny_dir("llava") / "config.json", tmp_path / "config.json")
    with pytest.raises(UnsupportedCheckpointError, match="no .*safetensors"):
        load_model(tmp_path, vision=False, language=True)


@pytest.mark.parametrize("qwen", ["qwen2-vl", "qwen2.5-vl"])
def test_qwen_video_input_layout(qwen: str) -> None:
    model = load_model(tiny_dir(qwen), vision=True, language=False)
    assert model.vision is not None
    image = make_test_image(8, 84, 56)
    still = model.vision.preprocess(image)
    # A still image is a 2-frame clip of itself (the processor broadcasts it over time).
    as_video = model.vision.preprocess_video([image, image])
    assert as_video.grid_thw == still.grid_thw and torch.equal(as_video.pixel_values, still.pixel_values)
    frames = [make_test_image(9 + i, 84, 56) for i in range(3)]
    video = model.vision.preprocess_video(frames)  # 3 frames -> last one repeated -> t = 2
    t, h, w = video.grid_thw
    assert (t, h, w) == (2, *still.grid_thw[1:]) and video.num_tokens == 2 * still.num_tokens
    # The second temporal group is frame 2 repeated: its rows equal frame 2 as a still image.
    third = model.vision.preprocess(frames[2]).pixel_values
    assert torch.equal(video.pixel_values[h * w :], third)
    out = model.vision.encode([video, still])
    assert [o.shape[0] for o in out] == [video.num_tokens, still.num_tokens]
    assert_close_fp32(out[1], model.vision.encode([still])[0])
    with pytest.raises(ValueError, match="different grids"):
        model.vision.preprocess_video([image, make_test_image(1, 200, 60)])


def test_llava_with_qwen2_text_backbone_matches_hf(tmp_path: Path) -> None:
    """LLaVA-style checkpoint whose text_config is Qwen2 (q/k/v biases, tied embeddings)."""
    import transformers

    base = tiny_dir("llava")
    config = json.loads((base / "config.json").read_text())
    text = transformers.Qwen2Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 5e4},
        tie_word_embeddings=True,
    )
    hf_config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**config["vision_config"]),
        text_config=text,
        image_token_index=299,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(hf_config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(tmp_path)
    shutil.copy(base / "preprocessor_config.json", tmp_path / "preprocessor_config.json")
    ours = load_model(tmp_path, vision=True, language=True)
    assert ours.spec.text_arch == "qwen2" and ours.spec.qkv_bias and ours.spec.tie_word_embeddings
    assert ours.language is not None and ours.vision is not None
    assert ours.language.lm_head.weight is ours.language.embed_tokens.weight
    vision_input = ours.vision.preprocess(make_test_image(4, 70, 50))
    assert vision_input.num_tokens == 17  # "full": CLS kept
    ids = torch.tensor([5, 6, 7] + [299] * 17 + [8, 9, 10, 11])
    with torch.no_grad():
        embeds = ours.language.embed(ids).clone()
        embeds[3:20] = ours.vision.encode([vision_input])[0]
        reference = model(input_ids=ids[None], pixel_values=vision_input.pixel_values[None]).logits[0]
    positions, _ = prompt_positions(ours.spec, ids.tolist(), [])
    (logits,) = PagedRunner(ours.language, 4).step([(0, embeds, positions)])
    assert_close_fp32(logits, reference)


def test_only_the_needed_part_is_read_from_safetensors(monkeypatch: pytest.MonkeyPatch) -> None:
    import safetensors

    read: list[str] = []
    real_open = safetensors.safe_open

    class Recording:
        def __init__(self, *args, **kwargs) -> None:
            self.handle = real_open(*args, **kwargs)

        def __enter__(self):
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *exc) -> None:
            self.handle.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, key: str):
            read.append(key)
            return self.inner.get_tensor(key)

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    load_model(tiny_dir("qwen2-vl"), vision=True, language=False)
    assert read and all(k.startswith("visual.") for k in read)
    read.clear()
    load_model(tiny_dir("qwen2-vl"), vision=False, language=True)
    assert read and not any(k.startswith("visual.") for k in read)
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(read)
