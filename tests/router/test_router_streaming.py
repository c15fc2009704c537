"""Stop strings over the processor's incremental detokenizer, SSE framing, and the event
pump's cancellation contract."""

from __future__ import annotations

import asyncio
import json

import pytest

from triptych.router.streaming import DONE, EventPump, OutputText, sse


def run(processor, text: str, stop: list[str], per_add: int = 1) -> tuple[list[str], OutputText]:
    ids = processor.encode(text)
    out = OutputText(processor.detokenizer(), stop)
    pieces = []
    for i in range(0, len(ids), per_add):
        pieces.append(out.add(ids[i:i + per_add]))
        if out.stopped:
            break
    pieces.append(out.finish())
    return pieces, out


@pytest.mark.parametrize("per_add", [1, 2, 5])
def test_no_stop_strings_reproduces_the_decode(processor, per_add: int) -> None:
    text = "Grüße, 你好! The end 🙂"
    pieces, out = run(processor, text, [], per_add)
    assert "".join(pieces) == text == processor.decode(processor.encode(text))
    assert out.num_tokens == len(processor.encode(text)) and not out.stopped


@pytest.mark.parametrize(("stop", "expected"), [
    (["world"], "Hello there, "),
    (["there", "Hello"], ""),  # the earliest match wins, whichever string it is
    (["o t"], "Hell"),  # spans two tokens
    (["!"], "Hello there, world"),
    (["absent"], "Hello there, world!"),
    (["d!"], "Hello there, worl"),
])
@pytest.mark.parametrize("per_add", [1, 3])
def test_stop_strings_trim_the_text(processor, stop, expected, per_add: int) -> None:
    pieces, out = run(processor, "Hello there, world!", stop, per_add)
    assert "".join(pieces) == expected
    assert out.stopped is (expected != "Hello there, world!")


def test_a_possible_stop_prefix_is_held_back(processor) -> None:
    out = OutputText(processor.detokenizer(), ["wor!d"])
    emitted = "".join(out.add([t]) for t in processor.encode("Hello wor"))
    assert emitted == "Hello "  # "wor" could still become "wor!d"
    emitted += "".join(out.add([t]) for t in processor.encode("ld"))
    assert emitted == "Hello world"  # it did not: released
    assert out.finish() == ""


def test_sse_framing() -> None:
    frame = sse({"a": "ü\n"})
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n") and frame.count(b"\n") == 2
    assert json.loads(frame[6:].decode()) == {"a": "ü\n"}
    assert DONE == b"data: [DONE]\n\n"


async def test_pump_relays_events_and_errors() -> None:
    async def events():
        yield 1
        yield 2
        raise ValueError("boom")

    pump = EventPump(events(), abort_timeout_s=1)
    await pump.prime()
    assert [await pump.next(), await pump.next()] == [1, 2]
    with pytest.raises(ValueError, match="boom"):
        await pump.next()
    assert await pump.next() is None
    await pump.close()


async def test_pump_close_cancels_once_and_waits_for_cleanup() -> None:
    seen: list[str] = []

    async def events():
        try:
            yield 1
            await asyncio.sleep(60)
            yield 2
        except asyncio.CancelledError:
            seen.append("cancelled")
            await asyncio.sleep(0.05)  # an abort call: must not be cut short
            seen.append("cleaned up")
            raise

    pump = EventPump(events(), abort_timeout_s=2)
    assert await pump.next() == 1
    await asyncio.sleep(0.01)
    await pump.close()
    assert seen == ["cancelled", "cleaned up"]
    assert await pump.next() is None


async def test_pump_close_is_bounded() -> None:
    async def stubborn():
        try:
            yield 1
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(60)  # an abort that hangs
            raise

    pump = EventPump(stubborn(), abort_timeout_s=0.1)
    await pump.next()
    async with asyncio.timeout(2):
        await pump.close()
