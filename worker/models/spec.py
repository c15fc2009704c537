"""What the worker needs to know about a checkpoint, read once from its config.json.

The config is parsed by transformers' `AutoConfig` (offline, local directory only) so that
every default the reference implementation fills in (rope_theta, rms_norm_eps, LLaVA's
sparse `text_config`, the flat vs nested Qwen2-VL layouts, `rope_scaling` vs
`rope_parameters`) is exactly the one transformers uses. Only plain values leave this
module: `ModelSpec` is a frozen dataclass, no transformers object is kept.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FAMILIES = ("qwen2-vl", "qwen2.5-vl", "llava")
_FAMILY_BY_MODEL_TYPE = {"qwen2_vl": "qwen2-vl", "qwen2_5_vl": "qwen2.5-vl", "llava": "llava"}
# Text backbones our LanguageModel implements (LLaVA's text_config.model_type).
_LLAVA_TEXT_TYPES = ("llama", "qwen2")
_ROPE_KINDS = ("default", "linear", "llama3")
# MLP activations layers.ACTIVATIONS implements.
SUPPORTED_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh")


class UnsupportedCheckpointError(ValueError):
    """The checkpoint directory is not one this worker can serve; the message says why."""


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters (transformers `rope_parameters`)."""

    theta: float
    kind: str = "default"  # one of _ROPE_KINDS
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # Qwen M-RoPE: how many of the head_dim/2 frequencies follow the t, h, w position axes.
    mrope_section: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ModelSpec:
    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    image_token_id: int
    video_token_id: int | None
    vision_start_token_id: int | None
    eos_token_ids: tuple[int, ...]
    uses_mrope: bool
    spatial_merge_size: int
    # --- decoder details (our LanguageModel needs them; see layers.py) ---
    text_arch: str  # "qwen2" (q/k/v biases) or "llama"
    intermediate_size: int
    rms_norm_eps: float
    hidden_act: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    rope: RopeSpec
    # Qwen2.5-VL video: temporal position step per second of video (None elsewhere).
    tokens_per_second: float | None = None


def read_spec(model_dir: str | Path) -> ModelSpec:
    """Read `config.json` (and `generation_config.json` for extra EOS ids) into a ModelSpec."""
    model_dir = Path(model_dir)
    raw = _read_raw_config(model_dir)
    config = load_hf_config(model_dir)
    family = _FAMILY_BY_MODEL_TYPE[raw["model_type"]]
    text = config.text_config
    if family == "llava":
        text_type = getattr(text, "model_type", None)
        if text_type not in _LLAVA_TEXT_TYPES:
            raise UnsupportedCheckpointError(
                f"{model_dir}: LLaVA text_config.model_type {text_type!r} is not supported "
                f"(supported: {', '.join(_LLAVA_TEXT_TYPES)})"
            )
        text_arch = text_type
    else:
        text_arch = "qwen2"
    _reject_sliding_window(model_dir, text)
    if getattr(text, "hidden_act", "silu") not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedCheckpointError(f"{model_dir}: hidden_act {text.hidden_act!r} is not supported")
    num_heads = _required(text, "num_attention_heads", model_dir)
    hidden = _required(text, "hidden_size", model_dir)
    if family == "llava":
        head_dim = getattr(text, "head_dim", None) or hidden // num_heads
    else:
        # Qwen2-VL's attention ignores a head_dim field: hidden_size // num_heads.
        head_dim = hidden // num_heads
    qkv_bias = text_arch == "qwen2" or bool(getattr(text, "attention_bias", False))
    uses_mrope = family != "llava"
    vision = config.vision_config
    return ModelSpec(
        family=family,
        num_layers=_required(text, "num_hidden_layers", model_dir),
        hidden_size=hidden,
        num_heads=num_heads,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        vocab_size=_required(text, "vocab_size", model_dir),
        max_model_len=_required(text, "max_position_embeddings", model_dir),
        image_token_id=_required(config, "image_token_id", model_dir),
        video_token_id=getattr(config, "video_token_id", None) if uses_mrope else None,
        vision_start_token_id=getattr(config, "vision_start_token_id", None) if uses_mrope else None,
        eos_token_ids=_eos_ids(model_dir, config),
        uses_mrope=uses_mrope,
        spatial_merge_size=getattr(vision, "spatial_merge_size", 1) if uses_mrope else 1,
        text_arch=text_arch,
        intermediate_size=_required(text, "intermediate_size", model_dir),
        rms_norm_eps=float(_required(text, "rms_norm_eps", model_dir)),
        hidden_act=getattr(text, "hidden_act", "silu"),
        qkv_bias=qkv_bias,
        o_bias=text_arch == "llama" and bool(getattr(text, "attention_bias", False)),
        mlp_bias=text_arch == "llama" and bool(getattr(text, "mlp_bias", False)),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        rope=_rope_spec(model_dir, text, uses_mrope, head_dim),
        tokens_per_second=getattr(vision, "tokens_per_second", None) if family == "qwen2.5-vl" else None,
    )


def load_hf_config(model_dir: Path) -> Any:
    """The transformers config object (used for its defaults and to build vision towers)."""
    raw = _read_raw_config(model_dir)
    if raw.get("model_type") not in _FAMILY_BY_MODEL_TYPE:
        raise UnsupportedCheckpointError(
            f"{model_dir}: model_type {raw.get('model_type')!r} is not supported "
            f"(supported: {', '.join(sorted(_FAMILY_BY_MODEL_TYPE))})"
        )
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except (ValueError, TypeError, KeyError, OSError) as exc:
        raise UnsupportedCheckpointError(f"{model_dir}: config.json is not usable: {exc}") from exc


def _read_raw_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise UnsupportedCheckpointError(f"{model_dir}: no config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UnsupportedCheckpointError(f"{path}: not valid JSON: {exc}") from exc
    if "model_type" not in raw:
        raise UnsupportedCheckpointError(f"{path}: missing field 'model_type'")
    if raw["model_type"] not in _FAMILY_BY_MODEL_TYPE:
        raise UnsupportedCheckpointError(
            f"{path}: model_type {raw['model_type']!r} is not supported "
            f"(supported: {', '.join(sorted(_FAMILY_BY_MODEL_TYPE))})"
        )
    return raw


def _required(config: Any, name: str, model_dir: Path) -> Any:
    value = getattr(config, name, None)
    if value is None:
        raise UnsupportedCheckpointError(f"{model_dir}: config.json lacks required field {name!r}")
    return value


def _reject_sliding_window(model_dir: Path, text: Any) -> None:
    # Our attention is full causal attention; a sliding window would silently differ.
    if getattr(text, "use_sliding_window", False) and getattr(text, "sliding_window", None):
        raise UnsupportedCheckpointError(f"{model_dir}: sliding-window attention is not supported")


def _rope_spec(model_dir: Path, text: Any, uses_mrope: bool, head_dim: int) -> RopeSpec:
    params = dict(getattr(text, "rope_parameters", None) or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "mrope":  # old Qwen2-VL spelling, transformers maps it to "default"
        kind = "default"
    if kind not in _ROPE_KINDS:
        raise UnsupportedCheckpointError(
            f"{model_dir}: rope_type {kind!r} is not supported (supported: {', '.join(_ROPE_KINDS)})"
        )
    theta = params.get("rope_theta", getattr(text, "rope_theta", None))
    if theta is None:
        raise UnsupportedCheckpointError(f"{model_dir}: config.json lacks 'rope_theta'")
    section = None
    if uses_mrope:
        # transformers' Qwen2VLRotaryEmbedding default when the config has none.
        section = tuple(params.get("mrope_section", (16, 24, 24)))
        if sum(section) != head_dim // 2:
            raise UnsupportedCheckpointError(
                f"{model_dir}: mrope_section {list(section)} does not sum to head_dim/2 = {head_dim // 2}"
            )
    return RopeSpec(
        theta=float(theta),
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        mrope_section=section,
    )


def _eos_ids(model_dir: Path, config: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (config.text_config, config, _generation_config(model_dir)):
        value = (
            source.get("eos_token_id") if isinstance(source, dict) else getattr(source, "eos_token_id", None)
        )
        for token in [value] if isinstance(value, int) else (value or []):
            if token not in ids:
                ids.append(int(token))
    return tuple(ids)


def _generation_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return {}
