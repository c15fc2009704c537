import pytest

from triptych.topology import InstanceType, Stage, TopologyError, format_topology, parse_topology


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("EPD", {InstanceType.EPD: 1}),
        ("1E1P1D", {InstanceType.E: 1, InstanceType.P: 1, InstanceType.D: 1}),
        ("2E1P2D", {InstanceType.E: 2, InstanceType.P: 1, InstanceType.D: 2}),
        ("1EP1D", {InstanceType.EP: 1, InstanceType.D: 1}),
        ("ED1P", {InstanceType.ED: 1, InstanceType.P: 1}),
        ("1E1PD", {InstanceType.E: 1, InstanceType.PD: 1}),
        ("1e1ep1p1d", {InstanceType.E: 1, InstanceType.EP: 1, InstanceType.P: 1, InstanceType.D: 1}),
        ("2P1D", {InstanceType.P: 2, InstanceType.D: 1}),  # text-only: no encoder needed
    ],
)
def test_parse_topology(spec, expected):
    assert parse_topology(spec) == expected


@pytest.mark.parametrize("spec", ["", "X", "1E1P", "2Q", "E P D", "1E1D", "0EPD"])
def test_bad_topology(spec):
    with pytest.raises(TopologyError):
        parse_topology(spec)


def test_roundtrip_and_stages():
    counts = parse_topology("2E1P2D")
    assert parse_topology(format_topology(counts)) == counts
    assert InstanceType.EP.stages == {Stage.ENCODE, Stage.PREFILL}
    assert not InstanceType.D.needs_vision and InstanceType.ED.needs_language


def test_v_token() -> None:
    """V (video decode) instances: their own token, no E/P/D stage, only beside an encoder."""
    assert parse_topology("2V1E1P1D") == {InstanceType.V: 2, InstanceType.E: 1, InstanceType.P: 1, InstanceType.D: 1}
    assert parse_topology("1v1epd") == {InstanceType.V: 1, InstanceType.EPD: 1}
    assert format_topology(parse_topology("1E1P1D2V")) == "2V1E1P1D"
    assert InstanceType.V.stages == frozenset() and InstanceType.V.decodes_video
    assert not any(InstanceType.V.runs(s) for s in Stage)
    with pytest.raises(TopologyError, match="encode"):
        parse_topology("1V1P1D")
