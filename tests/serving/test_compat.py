"""Checkpoints as real users have them: a LLaVA snapshot without processor_config.json (older
llava-hf releases) serves images with greedy parity over HTTP."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import servekit
from servekit import tiny_dir

pytestmark = pytest.mark.slow


def test_llava_without_processor_config_greedy_parity(tmp_path: Path) -> None:
    original = tiny_dir("llava")
    bare = tmp_path / "llava-no-processor-config"
    bare.mkdir()
    for f in original.iterdir():
        if f.name != "processor_config.json":
            shutil.copy(f, bare / f.name)
    cases = [c for c in servekit.make_cases(6) if c.images]
    # transformers needs the processor config to expand placeholders right; the weights and
    # tokenizer are the same files, so the original directory gives the reference.
    expected = [servekit.expected_ids(original, c) for c in cases]
    with servekit.start(bare, "EPD", tmp_path) as dep:
        results = asyncio.run(servekit.run_all(dep.router_url, [c.openai_body(bare.name) for c in cases]))
    for case, want, got in zip(cases, expected, results, strict=True):
        assert got["status"] == 200 and not got.get("error"), (case.index, got)
        assert got["token_ids"] == want, case.index
