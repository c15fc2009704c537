"""`triptych bench attention`: the report's figures are consistent with the bytes the kernel
must read, for both cache dtypes, and a machine without the kernel gets a clear refusal."""

from __future__ import annotations

import json

import pytest

from triptych.cli import main
from triptych.worker.attention import cpu_decode

needs_kernel = pytest.mark.skipif(cpu_decode.kernel() is None,
                                  reason="the CPU decode kernel does not build here (no C compiler)")


@needs_kernel
@pytest.mark.parametrize(("dtype", "element_size"), [("float32", 4), ("bfloat16", 2)])
def test_report_rates_are_the_kv_bytes_over_the_time(dtype: str, element_size: int,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "attention", "--contexts", "17", "40", "--batch", "3", "--kv-heads", "2",
                 "--group", "3", "--head-dim", "64", "--layers", "2", "--repeats", "1", "--stream-mb", "16",
                 "--dtype", dtype, "--json"]) in (0, None)
    report = json.loads(capsys.readouterr().out)
    assert report["shape"]["dtype"] == dtype and report["stream_read_gbs"] > 0
    assert [case["context"] for case in report["cases"]] == [17, 40]
    for case in report["cases"]:
        read = 3 * case["context"] * 2 * 2 * 64 * element_size  # sequences x tokens x (K, V) x heads x dim
        assert case["read_gbs"] == pytest.approx(read / (case["us_per_layer"] * 1e3), rel=0.02)
        assert case["of_stream_read"] == pytest.approx(case["read_gbs"] / report["stream_read_gbs"], abs=2e-3)


def test_without_the_kernel_it_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_decode, "kernel", lambda: None)
    with pytest.raises(SystemExit, match="CPU decode kernel does not build here"):
        main(["bench", "attention", "--contexts", "16", "--batch", "1", "--layers", "1", "--repeats", "1",
              "--stream-mb", "1"])
