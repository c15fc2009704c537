"""The shared stop-string matcher: cuts at token (piece) boundaries, earliest start wins,
hold-back of possible stop prefixes, and a per-piece cost bounded by the longest stop."""

from __future__ import annotations

import random
import time

import pytest

from triptych.stop_strings import StopMatcher


def stream(stops: list[str], pieces: list[str]) -> tuple[list[str], StopMatcher]:
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        out.append(m.add(p))
        if m.stopped:
            break
    out.append(m.flush())
    return out, m


def test_stop_at_a_token_boundary() -> None:
    out, m = stream(["world"], ["Hello ", "world", "!"])
    assert m.stopped and "".join(out) == "Hello "
    assert out[:2] == ["Hello ", ""]


def test_stop_split_across_tokens() -> None:
    out, m = stream(["o t"], ["Hello", " ", "there"])
    assert m.stopped and "".join(out) == "Hell"
    assert out[0] == "Hell"  # "o" could start "o t": held back until it is decided


def test_stop_inside_one_token_drops_the_rest_of_it() -> None:
    out, m = stream(["lo"], ["Hello there"])
    assert m.stopped and out == ["Hel", ""]


def test_earliest_start_wins_among_stops_completing_in_one_piece() -> None:
    # "c" completes first, but "abcd" starts first: it wins, as text.find would say.
    out, m = stream(["c", "abcd"], ["xabcdy"])
    assert m.stopped and "".join(out) == "x"
    out, _ = stream(["there", "Hello"], ["Hello there"])
    assert "".join(out) == ""


def test_a_stop_that_completes_earlier_ends_the_stream_first() -> None:
    # At the boundary after "c", "bc" has completed and "abcd" has not: "bc" stops it.
    out, m = stream(["abcd", "bc"], ["xab", "c", "d"])
    assert m.stopped and "".join(out) == "xa"


def test_multiple_stops_none_present_release_everything() -> None:
    out, m = stream(["zz", "qq", "xyz"], ["Hello ", "x", "y", "world"])
    assert not m.stopped and "".join(out) == "Hello xyworld"


def test_a_possible_prefix_is_held_back_then_released() -> None:
    m = StopMatcher(["wor!d"])
    assert m.add("Hello wor") == "Hello "
    assert m.add("ld") == "world"
    assert m.flush() == ""
    m = StopMatcher(["abc"])
    assert m.add("xab") == "x" and m.flush() == "ab"  # the end of the stream releases the tail


def test_unchecked_text_advances_the_search_without_stopping() -> None:
    m = StopMatcher(["ab"])
    assert m.add("xaby", check=False) == "xaby" and not m.stopped
    m = StopMatcher(["abc"])
    assert m.add("xab", check=False) == "x"
    assert m.add("c") == "" and m.stopped  # "ab" + "c": the match spans the unchecked text


def test_no_stops_pass_text_through() -> None:
    out, m = stream([], ["a", "b"])
    assert out == ["a", "b", ""] and not m.stopped


def _reference(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    """The rule, on the whole text: after each piece, cut at the earliest stop occurrence."""
    text = ""
    for p in pieces:
        text += p
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return text[:min(hits)], True
    return text, False


def _held(text: str, stops: list[str]) -> int:
    return max((k for k in range(1, len(text) + 1) for s in stops if len(s) > k and s.startswith(text[-k:])),
               default=0)


@pytest.mark.parametrize("seed", range(20))
def test_matches_the_whole_text_rule_on_random_streams(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 8)))) if text else []
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        m, released, seen = StopMatcher(stops), "", ""
        for p in pieces:
            released += m.add(p)
            seen += p
            if m.stopped:
                break
            assert released == seen[:len(seen) - _held(seen, stops)]  # held back: only a possible stop prefix
        released += m.flush()
        assert (released, m.stopped) == _reference(stops, pieces), (stops, pieces)


def _reference_included(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    """include_stop_str_in_output: the same cut, moved to the end of the stop string found
    (earliest start; of two starting together, the one listed first)."""
    text = ""
    for p in pieces:
        text += p
        hits = [(i, k) for k, s in enumerate(stops) if (i := text.find(s)) >= 0]
        if hits:
            i, k = min(hits)
            return text[:i + len(stops[k])], True
    return text, False


def test_include_keeps_the_stop_string() -> None:
    m = StopMatcher(["world"], include=True)
    assert m.add("Hello wor") == "Hello " and m.add("ld!") == "world" and m.stopped
    m = StopMatcher(["c", "abcd"], include=True)
    assert m.add("xabcdy") == "xabcd"  # the earliest-starting stop, whole


@pytest.mark.parametrize("seed", range(10))
def test_include_matches_the_whole_text_rule_on_random_streams(seed: int) -> None:
    rng = random.Random(1000 + seed)
    for _ in range(50):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        stops = list(dict.fromkeys(stops))
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 8)))) if text else []
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        m, released = StopMatcher(stops, include=True), ""
        for p in pieces:
            released += m.add(p)
            if m.stopped:
                break
        released += m.flush()
        assert (released, m.stopped) == _reference_included(stops, pieces), (stops, pieces)


def test_cost_is_bounded_by_the_longest_stop_not_the_text() -> None:
    stop = "a" * 999 + "b"  # 1,000 characters
    m = StopMatcher(["never", stop])
    t0 = time.process_time()
    # 8,000 streamed tokens: first text that cannot start the stop (a search that rescans
    # the tail for prefixes pays ~L^2 per token here), then text that keeps 999 characters
    # pending throughout.
    released = [m.add("xy") for _ in range(4000)] + [m.add("aa") for _ in range(4000)]
    released.append(m.add("b"))
    elapsed = time.process_time() - t0
    assert m.stopped and "".join(released) == "xy" * 4000 + "a" * (8000 - 999)
    assert elapsed < 0.5, f"{elapsed:.3f} s of CPU"
