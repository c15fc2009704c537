"""Changing an engine's role in place (EPDServe §3.2.4, onload): the weights and caches the
new role shares with the old stay where they are; only a part the new role adds (the
vision tower, the language model, a cache) is built, and one it drops is let go.

P <-> D keeps the language model and the KV cache (D also keeps P's MM cache, and with
`EngineConfig.keep_mm_cache` a D instance has one from the start: a switch to P then
allocates and registers nothing); E <-> P/D loads or frees the language model
and its KV cache, or the vision tower. The engine must hold no request: the instance
offloads and migrates its work before it calls `Engine.set_role`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from triptych.topology import InstanceType, Stage
from triptych.worker.engine.config import make_kv_cache, make_mm_cache

if TYPE_CHECKING:
    from triptych.worker.engine.engine import Engine


@dataclass
class PartsChanged:
    """What a role change did to the engine's parts (the instance re-registers caches)."""

    loaded: list[str]
    freed: list[str]

    @property
    def caches_dropped(self) -> bool:
        return any(p in ("kv_cache", "mm_cache") for p in self.freed)


def needs_mm(role: InstanceType, keep_mm_cache: bool = False) -> bool:
    """E and P instances hold an MM cache; with `keep_mm_cache` every LLM instance does."""
    return role.runs(Stage.ENCODE) or role.runs(Stage.PREFILL) or (keep_mm_cache and role.needs_language)


def keeps_handovers(engine: Engine, role: InstanceType) -> bool:
    """Whether hand-overs parked in `engine` (a decode's or a prefill's KV, an encode's
    embedding) may outlive a change to `role`, so that a switch need not wait for their
    pulls: they are released on confirm or lease expiry while the new role serves. An
    embedding stays parked in the MM cache if that stays (as `change_parts` decides); KV
    stays in the KV cache if that stays (P <-> D), and otherwise is detached with it
    (`Engine.set_role`): the dropped cache lives on, read by the pulls under the old
    transfer agent, until its last lease goes (`InstanceRuntime._retire`)."""
    return engine.mm is None or needs_mm(role, engine.config.keep_mm_cache) or role.needs_language


def drops_caches(engine: Engine, role: InstanceType) -> bool:
    """Whether a change to `role` frees a cache (as `change_parts` decides): the transfer
    agent that registered it lets it go, or, with hand-overs still to be read from it, a
    new agent takes over (`InstanceRuntime._needs_new_agent`)."""
    keep_mm = needs_mm(role, engine.config.keep_mm_cache) or role.needs_language
    return (engine.kv is not None and not role.needs_language) or (engine.mm is not None and not keep_mm)


def same_parts(engine: Engine, role: InstanceType) -> bool:
    """Whether `role` needs exactly the parts `engine` holds (P <-> D: the same language
    model, KV cache and — with `keep_mm_cache` — MM cache), so a change to it loads and
    frees nothing and may happen while requests still run (`Engine.set_role`)."""
    model = engine.model
    keep_mm = needs_mm(role, engine.config.keep_mm_cache) or (engine.mm is not None and role.needs_language)
    return (role.needs_vision == (model.vision is not None) and role.needs_language == (model.language is not None)
            and (engine.kv is not None) == role.needs_language and (engine.mm is not None) == keep_mm)


def drops_language_later(engine: Engine, role: InstanceType) -> bool:
    """Whether a change to `role` (D, P, PD, EP, ED or EPD -> E) may serve the new role at
    once, with the language model's work still in flight: the vision tower it adds joins
    the parts held (`Engine.join_parts`), and the language model and its KV cache are let
    go only once that work has left (`Engine.set_role` on an engine holding none of it).
    It adds no cache: the MM cache the new role needs is already there (an instance keeps
    one with `keep_mm_cache`)."""
    return engine.model.language is not None and not role.needs_language and (
        engine.mm is not None or not needs_mm(role, engine.config.keep_mm_cache))


def preload_parts(engine: Engine, role: InstanceType) -> Any:
    """The weights `role` needs that `engine` lacks (a `LoadedModel` with only those), or
    None: loaded while the engine still serves its old role (a switch overlaps this with
    its decodes' pre-copy), then handed to `change_parts`. Touches no engine state."""
    from triptych.worker.models.loader import load_model

    model, cfg = engine.model, engine.config
    want_vision = role.needs_vision and model.vision is None
    want_language = role.needs_language and model.language is None
    if not (want_vision or want_language):
        return None
    return load_model(cfg.model, vision=want_vision, language=want_language, dtype=cfg.torch_dtype,
                      device=cfg.device)


def join_parts(engine: Engine, role: InstanceType, preloaded: Any = None) -> None:
    """A change that drops its language model later (`drops_language_later`), with that
    model's work still running: the vision tower `role` adds (from `preloaded`, what
    `preload_parts` returned) joins the parts held, in place; the scheduler and its running
    requests stay, and a forward in flight keeps the runner it started with. A later
    `Engine.set_role(role)` on an engine with none of that work left drops the rest."""
    from triptych.worker.models.loader import LoadedModel

    vision = engine.model.vision or (preloaded.vision if preloaded is not None else None)
    if role.needs_vision and vision is None:
        raise RuntimeError(f"joining the parts of {role.value} needs the vision tower preloaded")
    engine.model = LoadedModel(engine.spec, vision, engine.model.language)
    engine.vision = engine.runner.vision = engine.admission.vision = engine.admission.videos.vision = vision


def change_parts(engine: Engine, role: InstanceType, preloaded: Any = None) -> PartsChanged:
    """Load what `role` needs that `engine` lacks (or take it from `preloaded`, what
    `preload_parts` returned for this change); drop what it no longer needs."""
    from triptych.worker.models.loader import LoadedModel

    model, cfg = engine.model, engine.config
    want_vision = role.needs_vision and model.vision is None
    want_language = role.needs_language and model.language is None
    loaded: list[str] = []
    freed: list[str] = []
    vision, language = model.vision, model.language
    if want_vision or want_language:
        new = preloaded if preloaded is not None else preload_parts(engine, role)
        vision, language = vision or new.vision, language or new.language
        loaded += ["vision"] * want_vision + ["language"] * want_language
    if not role.needs_vision and vision is not None:
        vision, freed = None, [*freed, "vision"]
    if not role.needs_language and language is not None:
        language, freed = None, [*freed, "language"]
    engine.model = LoadedModel(model.spec, vision, language)
    if language is not None and engine.kv is None:
        engine.kv = make_kv_cache(cfg, engine.spec, engine.max_model_len)
        loaded.append("kv_cache")
    elif language is None and engine.kv is not None:
        engine.kv = None
        freed.append("kv_cache")
    keep_mm = needs_mm(role, cfg.keep_mm_cache) or (engine.mm is not None and language is not None)
    if needs_mm(role, cfg.keep_mm_cache) and engine.mm is None:
        engine.mm = make_mm_cache(cfg, engine.spec, engine.max_model_len)
        loaded.append("mm_cache")
    elif not keep_mm and engine.mm is not None:
        engine.mm = None
        freed.append("mm_cache")
    return PartsChanged(loaded, freed)
