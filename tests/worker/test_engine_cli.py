"""`triptych generate` end to end (in-process CLI), against the engine and transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_reference import hf_generate, make_test_image

from triptych.cli import main
from triptych.processor import MultimodalProcessor

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/worker/conftest.py


def test_generate_tiny_text_only(capsys: pytest.CaptureFixture[str], qwen2_vl_dir: Path) -> None:
    assert main(["generate", "--model", "tiny", "--prompt", "hello there", "--max-tokens", "6"]) == 0
    out = capsys.readouterr().out
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]
    ids = hf_generate(qwen2_vl_dir, messages, [], 6)
    want = MultimodalProcessor.from_pretrained(qwen2_vl_dir).decode(ids)
    assert out == want + "\n" and want.strip()


def test_generate_with_an_image_matches_transformers(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                     llava_dir: Path) -> None:
    img = make_test_image(3, 84, 70)
    path = tmp_path / "cat.png"
    img.save(path)
    assert main(["generate", "--model", str(llava_dir), "--image", str(path), "--prompt", "what is it",
                 "--max-tokens", "8"]) == 0
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it"}]}]
    want = MultimodalProcessor.from_pretrained(llava_dir).decode(hf_generate(llava_dir, messages, [img], 8))
    assert capsys.readouterr().out == want + "\n"


def test_generate_seeded_sampling_is_reproducible(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--model", "tiny", "--prompt", "hi", "--max-tokens", "12", "--temperature", "1.0",
            "--seed", "5"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert main(argv) == 0
    assert capsys.readouterr().out == first
    assert main(argv[:-1] + ["6"]) == 0
    assert capsys.readouterr().out != first


def test_generate_reports_bad_input(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "x.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    assert main(["generate", "--model", "tiny", "--image", str(bad), "--prompt", "hi"]) == 2
    assert "error" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="no config.json there"):
        main(["generate", "--model", str(tmp_path), "--prompt", "hi"])


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["profile", "--out", "p.json"],
                                     ["serve"], ["bench", "switch"]])
def test_a_model_that_is_not_a_checkpoint_is_a_one_line_error(command: list[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*command, "--model", str(tmp_path / "nowhere")])
    assert exc.value.code == f"--model '{tmp_path / 'nowhere'}': no config.json there (expected a checkpoint " \
                             "directory, or 'tiny')"
