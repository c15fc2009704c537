"""Tiny random-weight checkpoints of the supported families, built offline.

`make_tiny_model` writes a standard Hugging Face checkpoint directory (config.json,
model.safetensors, tokenizer, preprocessor config, chat template, generation config) that
`AutoProcessor` and the family's `*ForConditionalGeneration` load as they would a real one:
the configs are the families' real config classes with only the sizes shrunk, the chat
templates are the real ones, and the tokenizer is a byte-level BPE trained here on a small
built-in corpus (deterministic).

Weights are drawn with std = fan_in^-1/2 (embeddings std 1, the LM head a little hotter) so
activations stay O(1) through every layer and logits have clear top-1/top-2 margins:
with transformers' default init (std 0.02) the logits are nearly flat and greedy parity
between two correct implementations becomes a coin toss. Biases and norm weights are
perturbed away from 0/1 so a loader that drops them fails parity tests.

torch and transformers are imported inside the builders only: importing this module
(e.g. for `tiny_model_path`) stays cheap.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FAMILIES = ("qwen2-vl", "qwen2.5-vl", "llava")
SIZES = ("tiny", "small")

# Bump when the layout or the weights of the generated checkpoints change: cached
# builds under $TRIPTYCH_CACHE are keyed by it, so stale ones are never reused.
FORMAT_VERSION = 2
MARKER = "triptych_tiny.json"  # written last: its presence means the build completed

# --- chat templates (verbatim from the released checkpoints) -------------------------

# Qwen/Qwen2-VL-7B-Instruct and Qwen/Qwen2.5-VL-7B-Instruct ship the same template.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# llava-hf/llava-1.5-7b-hf
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': '}}{% endif %}{# Render all images first #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

# Qwen2-VL's added tokens, in the released order (they follow the BPE vocabulary).
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)
LLAVA_LEADING_SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2 as in Llama
LLAVA_TRAILING_SPECIALS = ("<image>", "<pad>")  # appended after the vocabulary, as in llava-hf

# --- sizes ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Dims:
    vocab: int  # total tokenizer size = model vocab_size (BPE + specials)
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    mrope_section: tuple[int, int, int]  # sums to head_dim // 2
    vis_dim: int
    vis_depth: int
    vis_heads: int
    vis_intermediate: int
    qwen_min_pixels: int
    qwen_max_pixels: int
    qwen_window: int  # Qwen2.5-VL window attention size (pixels)
    clip_image_size: int


DIMS: dict[str, Dims] = {
    # Typical test images (56x56 .. 112x84) give 4-12 Qwen visual tokens; CLIP 56px gives 16.
    "tiny": Dims(vocab=1536, hidden=64, layers=4, heads=4, kv_heads=2, intermediate=192,
                 mrope_section=(2, 3, 3), vis_dim=32, vis_depth=2, vis_heads=2, vis_intermediate=64,
                 qwen_min_pixels=56 * 56, qwen_max_pixels=16 * 28 * 28, qwen_window=56,
                 clip_image_size=56),
    # A few tens of millions of parameters: large enough that CPU benchmarks measure the
    # matmuls, not Python overhead.
    "small": Dims(vocab=8192, hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1408,
                  mrope_section=(8, 12, 12), vis_dim=128, vis_depth=4, vis_heads=4,
                  vis_intermediate=256, qwen_min_pixels=56 * 56, qwen_max_pixels=64 * 28 * 28,
                  qwen_window=112, clip_image_size=112),
}

CLIP_PATCH = 14
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

# --- tokenizer corpus -----------------------------------------------------------------

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A picture is worth a thousand words, and a
model that reads pictures must first learn to count them. In the image you can see a red
car parked next to a small house with a green door. There are two cats sleeping on the
windowsill, and a bird is sitting on the roof. The sky is blue and the sun is shining.
Describe this image in detail. What is shown in the picture? How many people are there?
What color is the shirt of the man on the left? Is it day or night? Where was this photo
taken? The weather looks cold; people are wearing coats, hats and scarves.
Serving large multimodal models is a pipeline of three stages: the vision encoder turns
each image into a sequence of embeddings, the prefill stage reads the whole prompt and
fills the key value cache, and the decode stage generates one token at a time. Splitting
the stages across separate instances lets each one scale on its own and keeps a burst of
large images from stalling the tokens of requests that are already decoding.
Once upon a time there was a little girl who lived in a village near the forest. Whenever
she went out, the little girl wore a red riding cloak, so everyone in the village called
her Little Red Riding Hood. One morning her mother said: take this basket to your grandmother,
she is ill and weak, and this will do her good. Go straight there and do not stop on the way.
Numbers and symbols matter too: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14 2.71 42 + - * / = % $ #
@ & ( ) [ ] { } < > ! ? , . ; : ' " _ ~ ` ^ | \\ The answer is 42. It costs $19.99 (tax included).
Hello, world! Thank you very much. You are welcome. Good morning, good evening, good night.
I think the image shows a cat, a dog and a horse standing in a field of yellow flowers.
The assistant answers the question about the image concisely and accurately.
Café, naïve, résumé, São Paulo, Zürich, 東京, 北京, Москва, 서울 — a few words from elsewhere.
"""

_SYLLABLES = (
    "ba be bi bo bu ca ce ci co cu da de di do du fa fe fi fo fu ga ge gi go gu ha he hi ho hu "
    "ja je ji jo ju ka ke ki ko ku la le li lo lu ma me mi mo mu na ne ni no nu pa pe pi po pu "
    "ra re ri ro ru sa se si so su ta te ti to tu va ve vi vo vu wa we wi wo za ze zi zo zu "
    "an en in on un ar er ir or ur al el il ol ul str pl tr th sh ch qu ght ing ion ent ous"
).split()


def _corpus(num_pseudo_words: int) -> list[str]:
    """The built-in text plus deterministic pseudo-words, so larger vocabularies still
    find pairs to merge (BPE stops when every distinct word is one token)."""
    rng = random.Random(1234)
    words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))
             for _ in range(num_pseudo_words)]
    lines = _CORPUS.splitlines()
    lines += [" ".join(words[i:i + 12]) for i in range(0, len(words), 12)]
    return lines * 3  # repetition gives the real-text pairs the higher frequencies


def _train_bpe(vocab_size: int, leading: tuple[str, ...], trailing: tuple[str, ...]) -> Any:
    """Byte-level BPE (GPT-2/Qwen style): any UTF-8 text encodes, nothing is <unk>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(trailing),
        special_tokens=list(leading),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(num_pseudo_words=vocab_size), trainer)
    tok.add_special_tokens(list(trailing))
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"BPE training gave {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    return tok


def _build_tokenizer(family: str, dims: Dims) -> Any:
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    if family == "llava":
        tok = _train_bpe(dims.vocab, LLAVA_LEADING_SPECIALS, LLAVA_TRAILING_SPECIALS)
        # Llama tokenizers prepend <s> to every encoded text (add_bos_token=True).
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
        return PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
            pad_token="<pad>", extra_special_tokens={"image_token": "<image>"},
            model_max_length=4096, padding_side="left", chat_template=LLAVA_CHAT_TEMPLATE)
    tok = _train_bpe(dims.vocab, (), QWEN_SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                              "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>"},
        model_max_length=32768, padding_side="left", chat_template=QWEN2_VL_CHAT_TEMPLATE)


# --- configs --------------------------------------------------------------------------


def _qwen_text_kwargs(dims: Dims, tok: Any) -> dict[str, Any]:
    return dict(
        vocab_size=dims.vocab, hidden_size=dims.hidden, intermediate_size=dims.intermediate,
        num_hidden_layers=dims.layers, num_attention_heads=dims.heads,
        num_key_value_heads=dims.kv_heads, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                         "mrope_section": list(dims.mrope_section)},
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        max_window_layers=dims.layers, use_sliding_window=False,
    )


def _qwen_ids(tok: Any) -> dict[str, int]:
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    return ids


def _qwen2_vl_config(dims: Dims, tok: Any) -> Any:
    from transformers import Qwen2VLConfig

    vision = dict(depth=dims.vis_depth, embed_dim=dims.vis_dim, hidden_size=dims.hidden,
                  mlp_ratio=dims.vis_intermediate // dims.vis_dim, num_heads=dims.vis_heads,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, hidden_act="quick_gelu")
    return Qwen2VLConfig(text_config=_qwen_text_kwargs(dims, tok), vision_config=vision,
                         tie_word_embeddings=False, **_qwen_ids(tok))


def _qwen25_vl_config(dims: Dims, tok: Any) -> Any:
    from transformers import Qwen2_5_VLConfig

    vision = dict(depth=dims.vis_depth, hidden_size=dims.vis_dim, out_hidden_size=dims.hidden,
                  intermediate_size=dims.vis_intermediate, num_heads=dims.vis_heads,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, hidden_act="silu",
                  window_size=dims.qwen_window, tokens_per_second=2,
                  # full attention in the last block, windowed attention before it (real: every 8th)
                  fullatt_block_indexes=[dims.vis_depth - 1])
    return Qwen2_5_VLConfig(text_config=_qwen_text_kwargs(dims, tok), vision_config=vision,
                            tie_word_embeddings=False, **_qwen_ids(tok))


def _llava_config(dims: Dims, tok: Any) -> Any:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(
        hidden_size=dims.vis_dim, intermediate_size=dims.vis_intermediate,
        num_hidden_layers=dims.vis_depth + 1,  # +1 so vision_feature_layer=-2 skips a real layer
        num_attention_heads=dims.vis_heads, image_size=dims.clip_image_size, patch_size=CLIP_PATCH,
        projection_dim=dims.vis_dim, hidden_act="quick_gelu", layer_norm_eps=1e-5)
    text = LlamaConfig(
        vocab_size=dims.vocab, hidden_size=dims.hidden, intermediate_size=dims.intermediate,
        num_hidden_layers=dims.layers, num_attention_heads=dims.heads,
        num_key_value_heads=dims.kv_heads, max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False)
    num_patches = (dims.clip_image_size // CLIP_PATCH) ** 2
    return LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids("<image>"),
        image_seq_length=num_patches, projector_hidden_act="gelu",
        vision_feature_select_strategy="default", vision_feature_layer=-2,
        multimodal_projector_bias=True, tie_word_embeddings=False)


# --- processors -----------------------------------------------------------------------


def _save_processor(family: str, dims: Dims, tok: Any, out: Path) -> None:
    """Tokenizer, image processor config and chat template, in the layout the released
    checkpoints use (preprocessor_config.json on its own; llava's processor_config.json
    flat). The parts are saved one by one because Qwen's processor classes cannot even be
    instantiated without torchvision (their video processor needs it)."""
    tok.save_pretrained(out)
    if family == "llava":
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        size = dims.clip_image_size
        CLIPImageProcessorPil(
            size={"shortest_edge": size}, crop_size={"height": size, "width": size},
            do_center_crop=True, do_resize=True, do_rescale=True, do_normalize=True,
            do_convert_rgb=True, resample=3, image_mean=CLIP_MEAN, image_std=CLIP_STD,
        ).save_pretrained(out)
        (out / "processor_config.json").write_text(json.dumps({
            "image_token": "<image>", "num_additional_image_tokens": 1, "patch_size": CLIP_PATCH,
            "processor_class": "LlavaProcessor", "vision_feature_select_strategy": "default",
        }, indent=2) + "\n")
        (out / "chat_template.jinja").write_text(LLAVA_CHAT_TEMPLATE)
    else:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        Qwen2VLImageProcessorPil(
            min_pixels=dims.qwen_min_pixels, max_pixels=dims.qwen_max_pixels, patch_size=14,
            temporal_patch_size=2, merge_size=2, image_mean=CLIP_MEAN, image_std=CLIP_STD,
        ).save_pretrained(out)
        (out / "chat_template.jinja").write_text(QWEN2_VL_CHAT_TEMPLATE)
    _fix_preprocessor_config(out / "preprocessor_config.json", family, dims)
    _fix_tokenizer_config(out / "tokenizer_config.json", family)


def _fix_preprocessor_config(path: Path, family: str, dims: Dims) -> None:
    """Write the keys the released preprocessor configs carry (min/max_pixels and the
    non-PIL processor type), so readers that expect a real checkpoint's file find them."""
    cfg = json.loads(path.read_text())
    if family == "llava":
        cfg["image_processor_type"] = "CLIPImageProcessor"
        cfg["processor_class"] = "LlavaProcessor"
    else:
        cfg["image_processor_type"] = "Qwen2VLImageProcessor"
        cfg["processor_class"] = "Qwen2VLProcessor" if family == "qwen2-vl" else "Qwen2_5_VLProcessor"
        cfg["min_pixels"] = dims.qwen_min_pixels
        cfg["max_pixels"] = dims.qwen_max_pixels
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _fix_tokenizer_config(path: Path, family: str) -> None:
    """As released: the generic fast tokenizer class name (older readers know it, transformers
    5 maps it to its tokenizers backend) and the chat template inline as well."""
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = LLAVA_CHAT_TEMPLATE if family == "llava" else QWEN2_VL_CHAT_TEMPLATE
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


# --- weights --------------------------------------------------------------------------


def _init_weights(model: Any, seed: int) -> None:
    """Overwrite every parameter from one seeded generator, in name order."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    owners = dict(model.named_modules())
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            owner = owners[name.rsplit(".", 1)[0]] if "." in name else model
            param.copy_(_draw(name, param, owner, gen))


def _draw(name: str, param: Any, owner: Any, gen: Any) -> Any:
    import torch

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(param.shape, generator=gen, dtype=torch.float32) * std + mean

    if isinstance(owner, torch.nn.Embedding) or name.endswith("class_embedding"):
        return normal(1.0)
    if param.ndim >= 2:
        fan_in = param[0].numel()
        # The LM head is hotter (std 4/sqrt(d)): logits with std ~4 give typical top-2
        # margins of ~0.5, far above fp32/bf16 noise, so greedy parity is not decided by rounding.
        scale = 4.0 if name.endswith("lm_head.weight") else 1.0
        return normal(scale / fan_in**0.5)
    if name.endswith("bias"):
        return normal(0.05)
    return normal(0.05, mean=1.0)  # norm weights


# --- building -------------------------------------------------------------------------

_MODEL_CLASS = {
    "qwen2-vl": "Qwen2VLForConditionalGeneration",
    "qwen2.5-vl": "Qwen2_5_VLForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
}
_CONFIG_BUILDERS = {"qwen2-vl": _qwen2_vl_config, "qwen2.5-vl": _qwen25_vl_config, "llava": _llava_config}


def _check_args(family: str, size: str) -> Dims:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {', '.join(SIZES)}")
    return DIMS[size]


def _generation_config(family: str, tok: Any) -> dict[str, Any]:
    if family == "llava":
        eos: int | list[int] = tok.eos_token_id
        bos = tok.bos_token_id
    else:
        eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
        bos = tok.convert_tokens_to_ids("<|endoftext|>")
    return {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": tok.pad_token_id,
            "do_sample": False, "transformers_version": _transformers_version()}


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def make_tiny_model(family: str, out: str | Path, seed: int = 0, size: str = "tiny") -> Path:
    """Write a random-weight checkpoint of `family` into `out` (created; existing files
    with the same names are overwritten). Offline and deterministic in (family, size, seed)."""
    import torch
    import transformers

    dims = _check_args(family, size)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = _build_tokenizer(family, dims)
    config = _CONFIG_BUILDERS[family](dims, tok)
    config.dtype = torch.float32
    model = getattr(transformers, _MODEL_CLASS[family])(config).eval()
    _init_weights(model, seed)
    model.save_pretrained(out, safe_serialization=True)
    _save_processor(family, dims, tok, out)
    (out / "generation_config.json").write_text(
        json.dumps(_generation_config(family, tok), indent=2) + "\n")
    (out / MARKER).write_text(json.dumps(
        {"family": family, "size": size, "seed": seed, "format_version": FORMAT_VERSION}) + "\n")
    return out


# --- cache ----------------------------------------------------------------------------


def cache_root() -> Path:
    env = os.environ.get("TRIPTYCH_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "triptych"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # held until the builder finishes; builds take seconds
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _is_current(path: Path) -> bool:
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("format_version") == FORMAT_VERSION


def tiny_model_path(family: str, size: str = "tiny", seed: int = 0) -> Path:
    """The checkpoint directory for (family, size, seed) under `$TRIPTYCH_CACHE/models`
    (default ~/.cache/triptych/models), built on first use.

    Built into a temporary sibling and renamed into place, under an flock, so concurrent
    callers (pytest-xdist workers, local-mode processes) never see a half-written one.
    A build from an older FORMAT_VERSION is replaced."""
    _check_args(family, size)
    models = cache_root() / "models"
    final = models / f"{family}-{size}-s{seed}"
    if _is_current(final):
        return final
    with _file_lock(models / f".{final.name}.lock"):
        if _is_current(final):
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.build.", dir=models))
        try:
            make_tiny_model(family, tmp, seed=seed, size=size)
            if final.exists():  # stale format or a broken leftover: move it out of the way first
                stale = Path(tempfile.mkdtemp(prefix=f".{final.name}.stale.", dir=models))
                os.rename(final, stale / "old")
                shutil.rmtree(stale, ignore_errors=True)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def cli_main(args: argparse.Namespace) -> int:
    path = make_tiny_model(args.family, args.out, seed=args.seed, size=args.size)
    print(path)
    return 0
