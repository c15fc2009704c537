"""Load only the parts of a checkpoint an instance's role needs.

An E instance builds the vision encoder and reads only vision tensors; a P/D instance
builds our LanguageModel and reads only LLM tensors. Tensors are read one by one with
`safe_open` (memory-mapped), selected by key prefix, so the other part's weights are
never materialised.

Checkpoint key layouts handled (transformers 5 in-memory names and the on-disk names
older and newer `save_pretrained` write):
    Qwen2-VL / 2.5-VL   model.language_model.* | model.*         -> LM
                        model.visual.* | visual.*                -> vision
    LLaVA               model.language_model.* | language_model.model.* | language_model.*
                        model.vision_tower.[vision_model.]* | vision_tower.[vision_model.]*
                        model.multi_modal_projector.* | multi_modal_projector.*
    all                 lm_head.* | language_model.lm_head.*     -> LM head
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..attention import select_backend
from .language import LanguageModel
from .spec import ModelSpec, UnsupportedCheckpointError, load_hf_config, read_spec
from .vision import VisionModel, build_vision_model

# (pattern, part, replacement) tried in order; the first match names the tensor.
_KEY_RULES: tuple[tuple[re.Pattern[str], str, str], ...] = tuple(
    (re.compile(pattern), part, repl)
    for pattern, part, repl in (
        (r"^(?:model\.)?language_model\.lm_head\.(.*)$", "lm", r"lm_head.\1"),
        (r"^lm_head\.(.*)$", "lm", r"lm_head.\1"),
        (r"^model\.language_model\.(.*)$", "lm", r"\1"),
        (r"^language_model\.model\.(.*)$", "lm", r"\1"),
        (r"^language_model\.(.*)$", "lm", r"\1"),
        (r"^(?:model\.)?visual\.(.*)$", "vision", r"visual.\1"),
        (r"^(?:model\.)?vision_tower\.(?:vision_model\.)?(.*)$", "vision", r"vision_tower.\1"),
        (r"^(?:model\.)?multi_modal_projector\.(.*)$", "vision", r"multi_modal_projector.\1"),
        (r"^model\.(.*)$", "lm", r"\1"),
    )
)


@dataclass
class LoadedModel:
    spec: ModelSpec
    vision: VisionModel | None
    language: LanguageModel | None


def load_model(
    model_dir: str | Path,
    *,
    vision: bool,
    language: bool,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> LoadedModel:
    """Build the requested parts and fill them with the checkpoint's tensors."""
    model_dir = Path(model_dir)
    spec = read_spec(model_dir)
    index = _tensor_index(model_dir)
    device = torch.device(device)
    vision_model = None
    language_model = None
    if vision:
        vision_model = build_vision_model(spec, load_hf_config(model_dir), model_dir)
        _load_weights(vision_model, index, "vision", dtype, device, model_dir)
        vision_model.to(device).eval()
    if language:
        backend = select_backend(device, spec.head_dim, dtype)
        with torch.device("meta"):  # no allocation or init: every parameter comes from the checkpoint
            language_model = LanguageModel(spec, backend=backend)
        _load_weights(language_model, index, "lm", dtype, device, model_dir)
        if spec.tie_word_embeddings:
            language_model.lm_head.weight = language_model.embed_tokens.weight
        language_model.reset_rope()
        language_model.fuse_projections()
        language_model.eval()
    return LoadedModel(spec, vision_model, language_model)


def canonical_key(key: str) -> tuple[str, str] | None:
    """(part, name inside our module) of a checkpoint tensor key, or None if unknown."""
    for pattern, part, repl in _KEY_RULES:
        if pattern.match(key):
            return part, pattern.sub(repl, key)
    return None


def _tensor_index(model_dir: Path) -> dict[str, tuple[str, Path]]:
    """Canonical name -> (checkpoint key, file) for every tensor, per part prefix `part:`."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UnsupportedCheckpointError(f"{model_dir}: no *.safetensors weight files")
    keys_by_file = _keys_from_index_json(model_dir) or {f: _file_keys(f) for f in files}
    index: dict[str, tuple[str, Path]] = {}
    for path, keys in keys_by_file.items():
        for key in keys:
            named = canonical_key(key)
            if named is not None:
                index[f"{named[0]}:{named[1]}"] = (key, path)
    return index


def _keys_from_index_json(model_dir: Path) -> dict[Path, list[str]] | None:
    path = model_dir / "model.safetensors.index.json"
    if not path.is_file():
        return None
    weight_map: dict[str, str] = json.loads(path.read_text()).get("weight_map", {})
    grouped: dict[Path, list[str]] = {}
    for key, file in weight_map.items():
        grouped.setdefault(model_dir / file, []).append(key)
    return grouped


def _file_keys(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return list(handle.keys())


def _load_weights(
    module: nn.Module,
    index: dict[str, tuple[str, Path]],
    part: str,
    dtype: torch.dtype,
    device: torch.device,
    model_dir: Path,
) -> None:
    """Read exactly the tensors `module` has parameters for, and assign them."""
    from safetensors import safe_open

    wanted = dict(module.state_dict(keep_vars=True))
    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    if part == "lm" and getattr(module, "spec", None) is not None and module.spec.tie_word_embeddings:
        params.discard("lm_head.weight")
        wanted.pop("lm_head.weight", None)
    missing = sorted(name for name in params if f"{part}:{name}" not in index)
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise UnsupportedCheckpointError(f"{model_dir}: checkpoint lacks {part} tensors: {shown}")
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name in wanted:
        if f"{part}:{name}" in index:
            key, path = index[f"{part}:{name}"]
            by_file.setdefault(path, []).append((name, key))
    state: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name, key in names:
                tensor = handle.get_tensor(key)
                if tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                state[name] = _check_shape(tensor, wanted[name], name, model_dir).to(device)
    module.load_state_dict(state, strict=False, assign=True)
    # Serving never trains: no autograd bookkeeping even outside no_grad/inference_mode.
    module.requires_grad_(False)


def _check_shape(tensor: torch.Tensor, target: torch.Tensor, name: str, model_dir: Path) -> torch.Tensor:
    if tuple(tensor.shape) != tuple(target.shape):
        raise UnsupportedCheckpointError(
            f"{model_dir}: tensor {name} has shape {tuple(tensor.shape)}, config implies {tuple(target.shape)}"
        )
    return tensor
