"""The router's HTTP-layer settings (one pydantic model, filled from the CLI or a test)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

MiB = 1 << 20
API_KEY_ENV = "TRIPTYCH_API_KEY"  # comma-separated keys, as an alternative to argv
ADMIN_TOKEN_ENV = "TRIPTYCH_ADMIN_TOKEN"
INTERNAL_TOKEN_ENV = "TRIPTYCH_INTERNAL_TOKEN"  # sent to workers on every /internal call


class RouterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: Path  # checkpoint directory: tokenizer, processor, chat template, config.json
    served_model_name: str | None = None  # default: the checkpoint folder's name
    max_model_len: int | None = Field(default=None, ge=2)  # default: from config.json

    api_keys: list[str] = []
    api_key_file: Path | None = None  # one key per line; blank lines and '#' comments skipped

    # Images: data: URLs always; http(s) only when enabled, and then only from these hosts
    # ("example.com" exactly, or "*.example.com" for its subdomains).
    allow_http_images: bool = False
    image_host_allowlist: list[str] = []
    image_fetch_timeout_s: float = Field(default=10.0, gt=0)
    max_image_bytes: int = Field(default=20 * MiB, ge=1)
    max_image_pixels: int = Field(default=4096 * 4096, ge=1)  # checked before decoding
    max_images_per_request: int = Field(default=16, ge=0)
    # All images of one request together (sizes come from the headers, before any decode).
    max_request_pixels: int = Field(default=4 * 4096 * 4096, ge=1)
    # Bytes fetched over http(s) for one request, across all its URLs.
    max_fetch_bytes_per_request: int = Field(default=64 * MiB, ge=1)
    # Fetching from loopback, private, link-local or cloud-metadata addresses (tests, trusted LANs).
    allow_private_image_hosts: bool = False
    # Videos (video_url parts): fetched like images (same allow-list and per-request fetch
    # budget), checked while demuxing, before any frame is decoded (docs/video.md).
    max_video_bytes: int = Field(default=48 * MiB, ge=1)
    max_videos_per_request: int = Field(default=4, ge=0)
    max_video_duration_s: float = Field(default=600.0, gt=0)
    max_video_frames: int = Field(default=36_000, ge=1)  # frames in the container
    max_video_frame_pixels: int = Field(default=1920 * 1088, ge=1)  # width x height of one frame
    max_video_sampled_frames: int = Field(default=768, ge=1)  # frames the model sees
    max_request_bytes: int = Field(default=64 * MiB, ge=1)
    max_messages: int = Field(default=1024, ge=1)
    max_content_parts: int = Field(default=4096, ge=1)  # across all messages
    max_prompt_chars: int = Field(default=1_000_000, ge=1)  # text in messages or prompt

    # Slow or vanished clients: every read and write of a connection has a deadline.
    header_read_timeout_s: float = Field(default=10.0, gt=0)
    body_read_timeout_s: float = Field(default=30.0, gt=0)
    send_timeout_s: float = Field(default=30.0, gt=0)  # one write to a client that stopped reading
    limit_concurrency: int = Field(default=2048, ge=1)  # open connections before new ones get 503

    # Who sees every instance (URLs, ids) on /health: holders of the admin token.
    admin_token: str | None = None
    admin_token_file: Path | None = None
    # What the workers' /internal/* endpoints take (worker/auth.py); never in argv.
    internal_token: str | None = None
    internal_token_file: Path | None = None

    # SLO (HydraInfer §2.3) for the attainment metrics.
    ttft_slo_s: float = Field(default=2.0, gt=0)
    tbt_slo_s: float = Field(default=0.2, gt=0)
    slo_attainment_target: float = Field(default=0.9, gt=0, le=1)  # goodput's bar (HydraInfer §2.3)
    slo_window: int = Field(default=1000, ge=1)  # requests in the attainment gauge's window

    health_timeout_s: float = Field(default=5.0, gt=0)
    # After a client disconnect, how long the backend's abort may take before we stop waiting.
    abort_timeout_s: float = Field(default=5.0, gt=0)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.resolve().name

    def resolved_max_model_len(self) -> int:
        if self.max_model_len is not None:
            return self.max_model_len
        return read_max_model_len(self.model)

    def load_api_keys(self) -> frozenset[str]:
        keys = {k.strip() for k in self.api_keys if k.strip()}
        keys |= {k.strip() for k in os.environ.get(API_KEY_ENV, "").split(",") if k.strip()}
        if self.api_key_file is not None:
            for line in self.api_key_file.read_text().splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    keys.add(line)
        return frozenset(keys)

    def load_admin_token(self) -> str | None:
        return read_secret(self.admin_token, self.admin_token_file, ADMIN_TOKEN_ENV)

    def load_internal_token(self) -> str | None:
        return read_secret(self.internal_token, self.internal_token_file, INTERNAL_TOKEN_ENV)

    @classmethod
    def from_cli(cls, args: argparse.Namespace, **overrides: Any) -> RouterConfig:
        """Build from `triptych router` arguments; attributes the namespace lacks keep defaults."""
        fields: dict[str, Any] = {
            "model": args.model,
            "served_model_name": getattr(args, "served_model_name", None),
            "api_keys": list(getattr(args, "api_key", None) or []),
            "api_key_file": getattr(args, "api_key_file", None),
            "allow_http_images": bool(getattr(args, "allow_http_images", False)),
            "image_host_allowlist": list(getattr(args, "image_host_allowlist", None) or []),
            "allow_private_image_hosts": bool(getattr(args, "allow_private_image_hosts", False)),
            "admin_token_file": getattr(args, "admin_token_file", None),
            "internal_token_file": getattr(args, "internal_token_file", None),
        }
        optional = {"max_images_per_request": "max_images_per_request", "ttft_slo_s": "ttft_slo",
                    "tbt_slo_s": "tbt_slo", "slo_attainment_target": "slo_attainment_target",
                    "max_model_len": "max_model_len"}
        fields.update({k: v for k, arg in optional.items() if (v := getattr(args, arg, None)) is not None})
        fields.update(overrides)
        return cls(**fields)


def read_max_model_len(model_dir: Path) -> int:
    """The language model's context length from a checkpoint's config.json (the text
    config's max_position_embeddings; multimodal configs nest it under text_config)."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    for section in (cfg.get("text_config") or {}, cfg):
        value = section.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"{path} has no max_position_embeddings; set max_model_len")


def read_placeholder_ids(model_dir: Path) -> frozenset[int]:
    """The token ids that stand for image/video embeddings in a prompt (config.json:
    Qwen's image_token_id/video_token_id, LLaVA's image_token_index)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return frozenset()
    keys = ("image_token_id", "video_token_id", "image_token_index", "video_token_index")
    return frozenset(v for k in keys if isinstance(v := cfg.get(k), int))


def read_secret(value: str | None, path: Path | None, env: str) -> str | None:
    """A token from (in order) the value given, a file, or the environment; None if unset.
    Secrets come from files or the environment so they never show in `ps` output."""
    if value:
        return value.strip() or None
    if path is not None:
        return Path(path).read_text().strip() or None
    return os.environ.get(env, "").strip() or None
