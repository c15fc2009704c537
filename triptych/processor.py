"""The request processor: chat messages + images -> prompt token ids with expanded visual
placeholders, the way the model's Hugging Face processor would produce them.

Torch-free on purpose: the router imports this and must never load torch. It reads the
checkpoint's own files (tokenizer.json through the `tokenizers` library, the Jinja chat
template, preprocessor_config.json, config.json) and re-implements only the parts of the HF
processors that decide token ids: the chat template environment, tokenization, and the
number of visual tokens per image (Qwen2-VL `smart_resize`; LLaVA's fixed crop). Tests
check the result token-for-token against transformers.

Images arrive as encoded bytes from clients, so decoding is defensive: the pixel count
from the header is checked before any pixel is decoded (decompression bombs), only common
still-image formats are accepted, and truncated or non-image data is a typed error.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import struct
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from PIL import Image, ImageOps
from tokenizers import Tokenizer

DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
ALLOWED_IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
MAX_ASPECT_RATIO = 200  # Qwen2-VL's smart_resize refuses more extreme images


# --- errors ---------------------------------------------------------------------------


class ProcessorError(ValueError):
    """Bad request input (the router answers 400)."""


class ImageError(ProcessorError):
    pass


class InvalidImageError(ImageError):
    """The bytes are not a decodable image of an accepted format."""


class ImageTooLargeError(ImageError):
    """The image has more pixels than allowed (checked before decoding)."""


class PromptError(ProcessorError):
    """Messages that cannot be rendered, or placeholders that do not match the images."""


class UnsupportedModelError(ValueError):
    """The checkpoint's family or processor settings are not supported here."""


# --- data -----------------------------------------------------------------------------


@dataclass(frozen=True)
class MMItem:
    """One image's (or video's: triptych.video_processing) placeholder run: token_ids[offset:offset+length]."""

    kind: Literal["image", "video"]
    index: int  # position among the request's images
    offset: int
    length: int
    grid_thw: tuple[int, int, int] | None  # Qwen: (t, h, w) in patches before merging; LLaVA: None
    content_hash: str
    width: int  # of the image as given (before the processor's resize)
    height: int
    second_per_grid_t: float | None = None  # Qwen2.5-VL videos: M-RoPE temporal spacing
    # Videos: the resolved sampling/pixel options (stage_protocol.VideoOptions fields) the
    # encoder needs to decode the same frames the router counted.
    video_options: Mapping[str, Any] | None = field(default=None, compare=False)
    # An image that is a video's sampled frame (LLaVA takes videos as images): the video's
    # MM key, the frame's position among the sampled frames and their count.
    frame_of: str | None = None
    frame_index: int = 0
    frame_count: int = 0

    @property
    def unit(self) -> str:
        """What is planned, sent and decoded as one: a frame's video, else the item itself."""
        return self.frame_of if self.frame_of is not None else self.content_hash


@dataclass(frozen=True)
class ProcessedPrompt:
    token_ids: list[int]
    mm_items: list[MMItem] = field(default_factory=list)
    # The decoded images, in image order: aligned with the "image" items of mm_items (a
    # video item has no entry here).
    images: list[ImageInput] = field(default_factory=list, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class ImageInput:
    """An image's displayed size and the hash that identifies its content (MM cache key),
    plus the decoded pixels when they were decoded. The router only probes headers
    (`probe`); the encode instance decodes (`from_bytes`)."""

    image: Image.Image | None
    content_hash: str
    width: int
    height: int

    @property
    def size(self) -> tuple[int, int]:
        return self.width, self.height

    @classmethod
    def from_bytes(cls, data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> ImageInput:
        image = decode_image(data, max_pixels)
        return cls(image, hashlib.sha256(data).hexdigest(), *image.size)

    @classmethod
    def probe(cls, data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> ImageInput:
        """Size (EXIF orientation applied) from the header alone: no pixel is decoded."""
        return cls(None, hashlib.sha256(data).hexdigest(), *probe_image(data, max_pixels))

    @classmethod
    def from_pil(cls, image: Image.Image) -> ImageInput:
        return cls(image, pil_content_hash(image), *image.size)


def pil_content_hash(image: Image.Image) -> str:
    """Hash of the decoded pixels, mode and size (for images given without their bytes)."""
    h = hashlib.sha256(f"{image.mode}:{image.width}x{image.height}:".encode())
    h.update(image.tobytes())
    return h.hexdigest()


# --- image decoding -------------------------------------------------------------------


def decode_image(data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """Decode untrusted image bytes. The size in the header is checked against `max_pixels`
    before decoding; EXIF orientation is applied (as transformers' `load_image` does, so the
    token count matches what HF computes for the same file)."""
    img = _open_checked(data, max_pixels)
    try:
        img.load()
        img = ImageOps.exif_transpose(img)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise InvalidImageError(f"corrupt or truncated image: {e}") from None
    return img


def probe_image(data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> tuple[int, int]:
    """(width, height) as `decode_image` would return them, read from the header only:
    format and pixel limit checked, EXIF orientation applied, no pixel decoded. Corrupt pixel
    data is found later, by the instance that decodes."""
    img = _open_checked(data, max_pixels)
    width, height = img.size
    return (height, width) if _exif_orientation(img, data) in _TRANSPOSING_ORIENTATIONS else (width, height)


# EXIF orientations that swap width and height (rotations by 90 or 270 degrees, transposes).
_TRANSPOSING_ORIENTATIONS = frozenset({5, 6, 7, 8})
_EXIF_ORIENTATION_TAG = 0x0112


def _open_checked(data: bytes, max_pixels: int) -> Image.Image:
    """Open lazily (header only) and check format and size."""
    if not data:
        raise InvalidImageError("empty image data")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=ALLOWED_IMAGE_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageTooLargeError(f"image too large: {e}") from None
    except Image.UnidentifiedImageError:  # its text names an in-memory buffer's repr: not for the client
        raise InvalidImageError(f"not a supported image ({', '.join(ALLOWED_IMAGE_FORMATS)}): "
                                "the data is none of these formats") from None
    except (OSError, ValueError, SyntaxError) as e:
        raise InvalidImageError(f"not a supported image ({', '.join(ALLOWED_IMAGE_FORMATS)}): {e}") from None
    width, height = img.size
    if width * height > max_pixels:
        raise ImageTooLargeError(f"image is {width}x{height} = {width * height} pixels; the limit is {max_pixels}")
    if width < 1 or height < 1:
        raise InvalidImageError(f"image has no pixels ({width}x{height})")
    return img


def _exif_orientation(img: Image.Image, data: bytes) -> int:
    raw = img.info.get("exif")
    if raw is None and img.format == "PNG":
        raw = _png_chunk(data, b"eXIf")  # PIL reads an eXIf chunk after the pixels only on load()
    if not raw:
        return 1
    exif = Image.Exif()
    try:
        exif.load(raw)
    except (OSError, ValueError, SyntaxError, struct.error):
        return 1  # unreadable EXIF: decode_image's exif_transpose ignores it too
    return int(exif.get(_EXIF_ORIENTATION_TAG, 1) or 1)


def _png_chunk(data: bytes, kind: bytes) -> bytes | None:
    """The payload of the first PNG chunk of `kind`, walking chunk headers (nothing inflated)."""
    pos = 8  # after the signature
    while pos + 8 <= len(data):
        length, tag = struct.unpack(">I4s", data[pos:pos + 8])
        if tag == kind:
            return data[pos + 8:pos + 8 + length]
        if tag == b"IEND":
            return None
        pos += 12 + length  # length, type, data, CRC
    return None


def _as_image_input(item: ImageInput | Image.Image | bytes, max_pixels: int) -> ImageInput:
    if isinstance(item, ImageInput):
        return item
    if isinstance(item, Image.Image):
        return ImageInput.from_pil(item)
    if isinstance(item, (bytes, bytearray, memoryview)):
        return ImageInput.from_bytes(bytes(item), max_pixels)
    raise TypeError(f"images must be PIL images, bytes or ImageInput, not {type(item).__name__}")


# --- visual token counts --------------------------------------------------------------


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's resize rule (transformers' `smart_resize`): both sides multiples of
    `factor`, area within [min_pixels, max_pixels], aspect ratio kept as well as possible."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidImageError(
            f"image aspect ratio {max(height, width) / min(height, width):.1f} exceeds {MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class QwenVisionRules:
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    do_resize: bool = True

    def grid_thw(self, width: int, height: int) -> tuple[int, int, int]:
        if self.do_resize:
            height, width = smart_resize(height, width, self.patch_size * self.merge_size,
                                         self.min_pixels, self.max_pixels)
        elif height % (self.patch_size * self.merge_size) or width % (self.patch_size * self.merge_size):
            raise InvalidImageError(f"{width}x{height} is not a multiple of {self.patch_size * self.merge_size}")
        return 1, height // self.patch_size, width // self.patch_size

    def num_tokens(self, width: int, height: int) -> int:
        t, h, w = self.grid_thw(width, height)
        return t * h * w // self.merge_size**2


@dataclass(frozen=True)
class LlavaVisionRules:
    pixel_height: int  # what the CLIP processor feeds the tower (crop size)
    pixel_width: int
    patch_size: int
    num_additional_image_tokens: int  # CLS
    select_strategy: str  # "default" drops CLS

    def grid_thw(self, width: int, height: int) -> None:
        return None

    def num_tokens(self, width: int, height: int) -> int:
        n = (self.pixel_height // self.patch_size) * (self.pixel_width // self.patch_size)
        n += self.num_additional_image_tokens
        return n - 1 if self.select_strategy == "default" else n


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _image_processor_config(model_dir: Path) -> dict[str, Any]:
    cfg = _read_json(model_dir / "preprocessor_config.json")
    if not cfg:  # transformers 5 may nest it inside processor_config.json
        cfg = _read_json(model_dir / "processor_config.json").get("image_processor", {})
    if not cfg:
        raise UnsupportedModelError(f"{model_dir}: no preprocessor_config.json")
    return cfg


def _qwen_rules(pp: dict[str, Any], vision: dict[str, Any]) -> QwenVisionRules:
    size = pp.get("size") or {}
    min_pixels = pp.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or 56 * 56
    max_pixels = pp.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or 28 * 28 * 1280
    return QwenVisionRules(
        patch_size=int(pp.get("patch_size") or vision.get("patch_size", 14)),
        merge_size=int(pp.get("merge_size") or vision.get("spatial_merge_size", 2)),
        temporal_patch_size=int(pp.get("temporal_patch_size") or vision.get("temporal_patch_size", 2)),
        min_pixels=int(min_pixels), max_pixels=int(max_pixels), do_resize=bool(pp.get("do_resize", True)))


def _llava_rules(pp: dict[str, Any], proc: dict[str, Any], config: dict[str, Any]) -> LlavaVisionRules:
    vision = config.get("vision_config", {})
    if pp.get("do_center_crop", True) and pp.get("crop_size"):
        crop = pp["crop_size"]
        height, width = (crop, crop) if isinstance(crop, int) else (crop["height"], crop["width"])
    elif isinstance(pp.get("size"), dict) and "height" in pp["size"]:
        height, width = pp["size"]["height"], pp["size"]["width"]
    else:
        raise UnsupportedModelError("LLaVA image processors without a fixed output size are not supported")
    patch = proc.get("patch_size") or vision.get("patch_size")
    if patch is None:
        raise UnsupportedModelError("LLaVA checkpoint names no patch_size")
    # The tower decides the feature count, not the processor config: CLIP prepends a class token
    # (which the "default" strategy drops again), SigLIP has none. Released llava-hf processors say
    # num_additional_image_tokens=1; older snapshots have no processor_config.json at all, and
    # trusting the (then default) 0 gave one placeholder too few for every image.
    extra = _TOWER_PREFIX_TOKENS.get(vision.get("model_type", "clip_vision_model"))
    if extra is None:
        raise UnsupportedModelError(f"LLaVA vision tower {vision.get('model_type')!r} is not supported "
                                    f"(supported: {', '.join(_TOWER_PREFIX_TOKENS)})")
    strategy = config.get("vision_feature_select_strategy") or proc.get("vision_feature_select_strategy", "default")
    return LlavaVisionRules(int(height), int(width), int(patch), extra, strategy)


# Tokens a vision tower puts before its patch features (CLIP: the class token).
_TOWER_PREFIX_TOKENS = {"clip_vision_model": 1}  # the worker loads CLIP towers only


# --- chat template --------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers' AssistantTracker
    also records where; we only need the text)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_chat_template(source: str) -> jinja2.Template:
    """The same sandboxed environment transformers renders chat templates in."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _read_chat_template(model_dir: Path, tok_cfg: dict[str, Any]) -> str:
    """Where transformers looks, in its order: the processor's template, then the tokenizer's."""
    if (model_dir / "chat_template.jinja").exists():
        return (model_dir / "chat_template.jinja").read_text()
    for name in ("chat_template.json", "processor_config.json"):
        template = _read_json(model_dir / name).get("chat_template")
        if isinstance(template, str):
            return template
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        template = {t["name"]: t["template"] for t in template}.get("default")
    if not isinstance(template, str):
        raise UnsupportedModelError(f"{model_dir}: no chat template")
    return template


def _plain(value: Any) -> Any:
    """JSON-plain copy of what the template sees (rich objects such as images become inert
    placeholders, as in transformers)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _cut_after_final_message(text: str, final: dict[str, Any]) -> str:
    """`text` cut right after the last message's text (transformers' continue_final_message:
    its last text part, found from the end; trailing spaces the template trimmed stay out)."""
    content = final.get("content")
    if isinstance(content, list):
        content = next((p["text"] for p in reversed(content) if "text" in p), None)
    if not content or not content.strip():
        raise PromptError("continue_final_message: the last message has no text to continue")
    at = text.rfind(content.strip())
    if at < 0:
        raise PromptError("continue_final_message: the chat template does not render the last message's text")
    kept = content.lstrip()
    end = at + len(kept) if text[at:at + len(kept)] == kept else at + len(content.strip())
    return text[:end]


def _validate_messages(messages: Sequence[dict[str, Any]]) -> None:
    if not messages:
        raise PromptError("messages must not be empty")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg:
            raise PromptError(f"message {i} must be an object with a 'role'")
        content = msg.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
            raise PromptError(f"message {i}: content must be a string or a list of parts")


# --- the processor --------------------------------------------------------------------


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class MultimodalProcessor:
    """Chat messages + images -> `ProcessedPrompt`, identical to the HF processor's ids."""

    def __init__(self, model_dir: Path, tokenizer: Tokenizer, chat_template: str,
                 special_tokens: dict[str, str], family: str, image_token_id: int,
                 vision: QwenVisionRules | LlavaVisionRules, eos_token_ids: tuple[int, ...],
                 max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> None:
        self.model_dir = model_dir
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens = special_tokens  # bos_token, eos_token, ... as the template sees them
        self.family = family
        self.image_token_id = image_token_id
        self.vision = vision
        self.eos_token_ids = eos_token_ids
        self.max_image_pixels = max_image_pixels
        self._template = compile_chat_template(chat_template)
        bos = special_tokens.get("bos_token")
        self.bos_token = bos
        self.bos_token_id = tokenizer.token_to_id(bos) if bos else None

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
                        ) -> MultimodalProcessor:
        model_dir = Path(model_dir)
        config = _read_json(model_dir / "config.json")
        if not config:
            raise UnsupportedModelError(f"{model_dir}: no config.json")
        if not (model_dir / "tokenizer.json").exists():
            raise UnsupportedModelError(f"{model_dir}: no tokenizer.json (only fast tokenizers are supported)")
        model_type = config.get("model_type")
        if model_type not in ("qwen2_vl", "qwen2_5_vl", "llava"):
            raise UnsupportedModelError(f"{model_dir}: model_type {model_type!r} is not supported "
                                        "(qwen2_vl, qwen2_5_vl, llava)")
        try:
            tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        except Exception as e:  # the Rust side raises a bare Exception
            raise UnsupportedModelError(f"{model_dir}/tokenizer.json: {e}") from None
        tok_cfg = _read_json(model_dir / "tokenizer_config.json")
        special = {k: s for k, v in tok_cfg.items()
                   if k.endswith("_token") and (s := _token_str(v)) is not None}
        pp = _image_processor_config(model_dir)
        if model_type in ("qwen2_vl", "qwen2_5_vl"):
            family = "qwen2-vl" if model_type == "qwen2_vl" else "qwen2.5-vl"
            image_token_id = config.get("image_token_id")
            vision: QwenVisionRules | LlavaVisionRules = _qwen_rules(pp, config.get("vision_config", {}))
        else:
            family = "llava"
            image_token_id = config.get("image_token_index", config.get("image_token_id"))
            vision = _llava_rules(pp, _read_json(model_dir / "processor_config.json"), config)
        if image_token_id is None:
            raise UnsupportedModelError(f"{model_dir}: config.json names no image token id")
        return cls(model_dir, tokenizer, _read_chat_template(model_dir, tok_cfg), special, family,
                   int(image_token_id), vision, _eos_token_ids(model_dir, config, tokenizer, special),
                   max_image_pixels)

    # -- prompt building --

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
               continue_final_message: bool = False, **template_kwargs: Any) -> str:
        """The chat template applied to `messages` (text, before tokenization); with
        `continue_final_message` the text ends inside the last message, right after its
        text, so that the model continues it (transformers' apply_chat_template rule)."""
        _validate_messages(messages)
        try:
            text = self._template.render(messages=_plain(list(messages)), tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **{**self.special_tokens, **_plain(template_kwargs)})
        except jinja2.TemplateError as e:
            raise PromptError(f"chat template failed: {e}") from None
        except (TypeError, AttributeError, KeyError) as e:  # malformed parts the template trips over
            raise PromptError(f"messages do not fit the chat template: {e}") from None
        return _cut_after_final_message(text, messages[-1]) if continue_final_message else text

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as the HF tokenizer gives them, special tokens (e.g. Llama's
        <s>) added unless the text already starts with the BOS token."""
        add_special = not (self.bos_token and text.startswith(self.bos_token))
        return self.tokenizer.encode(text, add_special_tokens=add_special).ids

    def process(self, messages: Sequence[dict[str, Any]],
                images: Sequence[ImageInput | Image.Image | bytes] = (),
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                **template_kwargs: Any) -> ProcessedPrompt:
        """Chat template (generation prompt added), tokenization, and each image placeholder
        expanded to that image's number of visual tokens."""
        inputs = [_as_image_input(img, self.max_image_pixels) for img in images]
        ids = self.encode(self.render(messages, add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final_message, **template_kwargs))
        return self.expand(ids, inputs)

    def process_text(self, prompt: str, images: Sequence[ImageInput | Image.Image | bytes] = ()
                     ) -> ProcessedPrompt:
        """A raw prompt (no chat template), e.g. for /v1/completions."""
        inputs = [_as_image_input(img, self.max_image_pixels) for img in images]
        return self.expand(self.encode(prompt), inputs)

    def expand(self, ids: list[int], images: Sequence[ImageInput]) -> ProcessedPrompt:
        """Replace the i-th image placeholder token in `ids` by image i's run of tokens."""
        positions = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(positions) != len(images):
            raise PromptError(f"the prompt has {len(positions)} image placeholder(s) but "
                              f"{len(images)} image(s) were given")
        out: list[int] = []
        items: list[MMItem] = []
        start = 0
        for index, (pos, img) in enumerate(zip(positions, images, strict=True)):
            out.extend(ids[start:pos])
            width, height = img.size
            length = self.vision.num_tokens(width, height)
            items.append(MMItem(kind="image", index=index, offset=len(out), length=length,
                                grid_thw=self.vision.grid_thw(width, height),
                                content_hash=img.content_hash, width=width, height=height))
            out.extend([self.image_token_id] * length)
            start = pos + 1
        out.extend(ids[start:])
        return ProcessedPrompt(token_ids=out, mm_items=items, images=list(images))

    def num_image_tokens(self, width: int, height: int) -> int:
        return self.vision.num_tokens(width, height)

    # -- output side --

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, skip_special_tokens=skip_special_tokens)

    @cached_property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)


def _eos_token_ids(model_dir: Path, config: dict[str, Any], tokenizer: Tokenizer,
                   special: dict[str, str]) -> tuple[int, ...]:
    """generation_config.json's eos ids (Qwen lists <|im_end|> and <|endoftext|>), else the
    config's, else the tokenizer's eos token."""
    found: list[int] = []
    for source in (_read_json(model_dir / "generation_config.json"), config.get("text_config", {}), config):
        eos = source.get("eos_token_id")
        if eos is not None:
            found = [eos] if isinstance(eos, int) else list(eos)
            break
    if not found and special.get("eos_token") and tokenizer.token_to_id(special["eos_token"]) is not None:
        found = [tokenizer.token_to_id(special["eos_token"])]
    return tuple(dict.fromkeys(int(i) for i in found))


# --- streaming detokenization ---------------------------------------------------------


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas for streaming.

    A character can span several byte-level tokens; decoding a prefix that ends inside it
    gives U+FFFD. We hold such text back until the character completes (the method of
    Hugging Face's text-generation-inference and vLLM: decode a short window before the
    new tokens and emit only the part past what was already emitted)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: a few tokens of context for spacing rules
        self._read_offset = 0  # tokens up to here are already emitted
        self._emitted: list[str] = []  # joined only when `text` is read: O(1) per token

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_ids: int | Sequence[int]) -> str:
        """Append token(s); return the newly completed text ("" while a character is split)."""
        self._ids.extend([token_ids] if isinstance(token_ids, int) else token_ids)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._emitted.append(delta)
        return delta

    def flush(self) -> str:
        """At the end of the stream: whatever is still held back (possibly with U+FFFD,
        when the model really produced an incomplete character)."""
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        delta = full[len(prefix):] if full.startswith(prefix) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self._emitted.append(delta)
        return delta

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._emitted)
