"""The torch-free request processor against transformers' processors, token for token."""

from __future__ import annotations

import base64
import hashlib
import io
import random
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from hf_reference import hf_inputs, hf_processor, make_test_image, png_bytes
from PIL import Image

from triptych.processor import (
    ImageInput,
    ImageTooLargeError,
    InvalidImageError,
    MultimodalProcessor,
    ProcessedPrompt,
    PromptError,
    UnsupportedModelError,
    decode_image,
)

# (width, height) lists: 0..3 images, tiny/huge/extreme aspect sizes that hit every branch
# of smart_resize (round, shrink to max_pixels, grow to min_pixels, clamp to one factor).
IMAGE_SETS = [
    [],
    [(56, 56)],
    [(112, 84), (20, 33)],
    [(640, 480), (57, 91), (1000, 30)],
    [(84, 112), (224, 224), (29, 29)],
]


@pytest.fixture(scope="module")
def processors() -> dict[str, MultimodalProcessor]:
    return {}


def _proc(model_dir: Path, cache: dict[str, MultimodalProcessor]) -> MultimodalProcessor:
    key = str(model_dir)
    if key not in cache:
        cache[key] = MultimodalProcessor.from_pretrained(model_dir)
    return cache[key]


def _conversation(num_images: int, interleave: bool) -> list[dict]:
    content: list[dict] = [{"type": "text", "text": "Look at these: "}]
    for i in range(num_images):
        content.append({"type": "image"})
        if interleave:
            content.append({"type": "text", "text": f" (#{i} café 東京 🙂) "})
    content.append({"type": "text", "text": "What do you see?"})
    return [
        {"role": "user", "content": [{"type": "text", "text": "Hello there."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hi! How can I help?"}]},
        {"role": "user", "content": content},
    ]


@pytest.mark.parametrize("sizes", IMAGE_SETS, ids=lambda s: f"{len(s)}img")
@pytest.mark.parametrize("interleave", [False, True], ids=["grouped", "interleaved"])
def test_token_ids_match_hf(tiny_model_dir: Path, processors: dict, sizes: list, interleave: bool) -> None:
    proc = _proc(tiny_model_dir, processors)
    images = [make_test_image(i, w, h) for i, (w, h) in enumerate(sizes)]
    messages = _conversation(len(images), interleave)
    ref = hf_inputs(str(tiny_model_dir), messages, images)
    ours = proc.process(messages, images)
    assert ours.token_ids == ref["input_ids"][0].tolist()
    _check_items(proc, ours, images)
    if proc.family != "llava" and images:
        assert [m.grid_thw for m in ours.mm_items] == [tuple(g) for g in ref["image_grid_thw"].tolist()]


def _check_items(proc: MultimodalProcessor, ours: ProcessedPrompt, images: list[Image.Image]) -> None:
    ids = ours.token_ids
    runs, i = [], 0
    while i < len(ids):  # maximal runs of the image token
        if ids[i] == proc.image_token_id:
            j = i
            while j < len(ids) and ids[j] == proc.image_token_id:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    if proc.family == "llava" and len(images) > 1:
        # llava-1.5's template puts all images back to back ("<image>\n<image>\n"): runs are
        # separated by the newline token only, so compare item by item instead.
        runs = [(m.offset, m.length) for m in ours.mm_items]
        for m in ours.mm_items:
            assert set(ids[m.offset:m.offset + m.length]) == {proc.image_token_id}
            assert ids[m.offset + m.length] != proc.image_token_id
    assert [(m.offset, m.length) for m in ours.mm_items] == runs
    assert [m.index for m in ours.mm_items] == list(range(len(images)))
    assert [(m.width, m.height) for m in ours.mm_items] == [im.size for im in images]
    for m in ours.mm_items:
        assert m.length == proc.num_image_tokens(m.width, m.height)


def test_string_content_and_system_prompt(qwen2_vl_dir: Path, processors: dict) -> None:
    proc = _proc(qwen2_vl_dir, processors)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
    assert proc.process(messages).token_ids == hf_inputs(str(qwen2_vl_dir), messages, [])["input_ids"][0].tolist()


def test_add_vision_id_matches_hf(qwen25_vl_dir: Path, processors: dict) -> None:
    proc = _proc(qwen25_vl_dir, processors)
    images = [make_test_image(3, 56, 84), make_test_image(4, 84, 56)]
    messages = _conversation(2, interleave=True)
    ref = hf_inputs(str(qwen25_vl_dir), messages, images, add_vision_id=True)["input_ids"][0].tolist()
    ours = proc.process(messages, images, add_vision_id=True).token_ids
    assert ours == ref
    assert proc.decode(ours).count("Picture ") == 2


def test_qwen_placeholder_layout(qwen2_vl_dir: Path, processors: dict) -> None:
    proc = _proc(qwen2_vl_dir, processors)
    tok = proc.tokenizer
    out = proc.process(_conversation(2, True), [make_test_image(0, 56, 56), make_test_image(1, 112, 84)])
    for m in out.mm_items:
        assert out.token_ids[m.offset - 1] == tok.token_to_id("<|vision_start|>")
        assert out.token_ids[m.offset + m.length] == tok.token_to_id("<|vision_end|>")
    assert [m.length for m in out.mm_items] == [4, 12]  # 56x56 -> 2x2 merged; 112x84 -> 4x3


def test_llava_token_count_and_bos(llava_dir: Path, processors: dict) -> None:
    proc = _proc(llava_dir, processors)
    assert proc.num_image_tokens(56, 56) == proc.num_image_tokens(1000, 20) == 16  # (56/14)^2, CLS dropped
    out = proc.process_text("USER: <image>\nHi ASSISTANT:", [make_test_image(0, 60, 70)])
    assert out.token_ids[0] == proc.bos_token_id == 1
    ref = hf_processor(str(llava_dir))(text="USER: <image>\nHi ASSISTANT:",
                                        images=[make_test_image(0, 60, 70)])["input_ids"][0]
    assert out.token_ids == list(ref)


def test_content_hash(qwen2_vl_dir: Path, processors: dict) -> None:
    proc = _proc(qwen2_vl_dir, processors)
    img = make_test_image(5, 64, 48)
    data = png_bytes(img)
    msgs = _conversation(1, False)
    from_bytes = proc.process(msgs, [data]).mm_items[0]
    assert from_bytes.content_hash == hashlib.sha256(data).hexdigest()
    from_pil = proc.process(msgs, [img]).mm_items[0]
    assert from_pil.content_hash == proc.process(msgs, [img.copy()]).mm_items[0].content_hash
    assert from_pil.content_hash != proc.process(msgs, [make_test_image(6, 64, 48)]).mm_items[0].content_hash
    assert proc.process(msgs, [data]).token_ids == proc.process(msgs, [img]).token_ids


def test_exif_orientation_matches_transformers_load_image(qwen2_vl_dir: Path, processors: dict) -> None:
    from transformers.image_utils import load_image

    img = make_test_image(7, 112, 56)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90: displayed as 56x112
    buf = io.BytesIO()
    img.save(buf, format="JPEG", exif=exif)
    data = buf.getvalue()
    assert decode_image(data).size == (56, 112)
    proc = _proc(qwen2_vl_dir, processors)
    msgs = _conversation(1, False)
    hf_img = load_image(base64.b64encode(data).decode())
    ref = hf_inputs(str(qwen2_vl_dir), msgs, [hf_img])["input_ids"][0].tolist()
    assert proc.process(msgs, [data]).token_ids == ref


# --- bad input ------------------------------------------------------------------------


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height, with a tiny (bogus) payload: a bomb."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_pixel_limit_is_checked_before_decoding() -> None:
    with pytest.raises(ImageTooLargeError, match="limit"):
        decode_image(_png_header_only(20000, 20000), max_pixels=10_000_000)
    with pytest.raises(ImageTooLargeError):  # beyond PIL's own bomb threshold too
        decode_image(_png_header_only(60000, 60000), max_pixels=10**12)
    data = png_bytes(make_test_image(0, 100, 100))
    with pytest.raises(ImageTooLargeError):
        decode_image(data, max_pixels=9_999)
    assert decode_image(data, max_pixels=10_000).size == (100, 100)


def test_processor_applies_its_pixel_limit(llava_dir: Path) -> None:
    proc = MultimodalProcessor.from_pretrained(llava_dir, max_image_pixels=1000)
    with pytest.raises(ImageTooLargeError):
        proc.process(_conversation(1, False), [png_bytes(make_test_image(0, 40, 40))])


@pytest.mark.parametrize("data", [b"", b"hello, not an image", b"\x89PNG\r\n\x1a\n" + b"\0" * 20,
                                  b"GIF89a" + b"\xff" * 3], ids=["empty", "text", "bad-png", "bad-gif"])
def test_not_an_image(data: bytes) -> None:
    with pytest.raises(InvalidImageError):
        decode_image(data)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_image(fmt: str) -> None:
    buf = io.BytesIO()
    make_test_image(1, 64, 64).save(buf, format=fmt)
    with pytest.raises(InvalidImageError, match="truncated|corrupt"):
        decode_image(buf.getvalue()[: len(buf.getvalue()) // 2])


def test_unaccepted_format_is_rejected() -> None:
    buf = io.BytesIO()
    make_test_image(1, 16, 16).save(buf, format="PPM")
    with pytest.raises(InvalidImageError, match="not a supported image") as err:
        decode_image(buf.getvalue())
    # PIL's own text names the in-memory buffer (`<_io.BytesIO object at 0x...>`): not for a client.
    assert "BytesIO" not in str(err.value) and "none of these formats" in str(err.value)


def test_extreme_aspect_ratio(qwen2_vl_dir: Path, processors: dict) -> None:
    with pytest.raises(InvalidImageError, match="aspect ratio"):
        _proc(qwen2_vl_dir, processors).process(_conversation(1, False), [Image.new("RGB", (1, 300))])


def test_placeholder_count_mismatch(tiny_model_dir: Path, processors: dict) -> None:
    proc = _proc(tiny_model_dir, processors)
    img = make_test_image(0, 56, 56)
    with pytest.raises(PromptError, match="1 image placeholder"):
        proc.process(_conversation(1, False), [img, img])
    with pytest.raises(PromptError, match="2 image placeholder"):
        proc.process(_conversation(2, False), [img])
    # A user who types the placeholder token cannot smuggle in extra image slots.
    token = "<image>" if proc.family == "llava" else "<|image_pad|>"
    sneaky = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"x {token} y"}]}]
    with pytest.raises(PromptError):
        proc.process(sneaky, [img])


@pytest.mark.parametrize("messages", [[], [{"content": "no role"}], [{"role": "user", "content": 5}],
                                      [{"role": "user", "content": ["not a part"]}]])
def test_malformed_messages(qwen2_vl_dir: Path, processors: dict, messages: list) -> None:
    with pytest.raises(PromptError):
        _proc(qwen2_vl_dir, processors).process(messages)


def test_bad_image_type(qwen2_vl_dir: Path, processors: dict) -> None:
    with pytest.raises(TypeError):
        _proc(qwen2_vl_dir, processors).process(_conversation(1, False), ["path/to/file.png"])


def test_unsupported_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "preprocessor_config.json").write_text("{}")
    with pytest.raises(UnsupportedModelError):
        MultimodalProcessor.from_pretrained(tmp_path)


# --- output side ----------------------------------------------------------------------


def test_eos_token_ids(tiny_model_dir: Path, processors: dict) -> None:
    proc = _proc(tiny_model_dir, processors)
    t = proc.tokenizer
    expected = ((t.token_to_id("</s>"),) if proc.family == "llava"
                else (t.token_to_id("<|im_end|>"), t.token_to_id("<|endoftext|>")))
    assert proc.eos_token_ids == expected


def test_decode_matches_hf(tiny_model_dir: Path, processors: dict) -> None:
    proc = _proc(tiny_model_dir, processors)
    hf_tok = hf_processor(str(tiny_model_dir)).tokenizer
    ids = random.Random(0).sample(range(proc.vocab_size), 200)
    assert proc.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    assert proc.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids, skip_special_tokens=False)


def test_incremental_detokenizer_never_splits_characters(tiny_model_dir: Path, processors: dict) -> None:
    proc = _proc(tiny_model_dir, processors)
    text = "Zürich 東京 🙂🙂 naïve — done."
    ids = proc.tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) > len(text) // 2  # multi-byte characters span several tokens
    detok = proc.detokenizer()
    deltas = [detok.add(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == text


def test_incremental_detokenizer_on_random_ids(tiny_model_dir: Path, processors: dict) -> None:
    proc = _proc(tiny_model_dir, processors)
    rng = random.Random(1)
    for _ in range(20):
        ids = [rng.randrange(proc.vocab_size) for _ in range(rng.randint(1, 40))]
        detok = proc.detokenizer()
        pieces = [detok.add(ids[i:i + 3]) for i in range(0, len(ids), 3)]
        assert "".join(pieces) + detok.flush() == proc.decode(ids)
        assert detok.text == proc.decode(ids)


def test_import_is_torch_free() -> None:
    code = ("import sys, triptych.processor; "
            "bad = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_image_input_from_bytes() -> None:
    data = png_bytes(make_test_image(2, 30, 20))
    item = ImageInput.from_bytes(data)
    assert item.image.size == (30, 20) and item.content_hash == hashlib.sha256(data).hexdigest()


def _without_processor_config(src: Path, dst: Path) -> Path:
    """A copy of a checkpoint as older llava-hf snapshots ship it: no processor_config.json."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "processor_config.json":
            shutil.copy(f, dst / f.name)
    return dst


def test_llava_without_processor_config_counts_tokens_from_the_tower(llava_dir: Path, tmp_path: Path) -> None:
    bare = _without_processor_config(llava_dir, tmp_path / "llava-bare")
    proc = MultimodalProcessor.from_pretrained(bare)
    assert proc.num_image_tokens(56, 56) == 16  # CLIP: 16 patches + class token, the default strategy drops it
    image = make_test_image(0, 60, 70)
    out = proc.process_text("USER: <image>\nHi ASSISTANT:", [image])
    # transformers' reference needs the processor config (without it, it expands one token short);
    # the weights and tokenizer are the same files, so the original directory is the reference.
    ref = hf_processor(str(llava_dir))(text="USER: <image>\nHi ASSISTANT:", images=[image])["input_ids"][0]
    assert out.token_ids == list(ref)
