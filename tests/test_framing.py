"""The local socket's framing: messages come out as they went in, however the stream is
cut, and oversized ones are reported in their place without losing step."""

from __future__ import annotations

import random

from kvd.framing import HEADER, FrameReader, Oversized, frame


def test_messages_survive_any_cuts_and_oversized_ones_are_reported_in_place() -> None:
    rng = random.Random(7)
    limit, skip_above = 1000, 5000
    sent = [rng.randbytes(rng.choice([0, 1, 3, 999, 1000, 1001, 4999, 5001, 20000]))
            for _ in range(300)]
    stream = b"".join(frame(m) for m in sent)
    for trial in range(20):
        reader = FrameReader(limit, skip_above)
        got: list[bytes | Oversized] = []
        pos = 0
        while pos < len(stream):
            step = rng.randint(1, 1 if trial == 0 else 3000)
            got.extend(reader.feed(stream[pos : pos + step]))
            pos += step
        assert reader.pending_bytes == 0
        assert len(got) == len(sent)
        for m, g in zip(sent, got, strict=True):
            if len(m) <= limit:
                assert g == m
            elif len(m) <= skip_above:
                assert g == Oversized(len(m), m)  # read whole: its req_id can be found
            else:
                assert g == Oversized(len(m), b"")  # never held


def test_an_oversized_length_is_reported_before_its_bytes_arrive() -> None:
    reader = FrameReader(10, 100)
    assert list(reader.feed(HEADER.pack(2**32 - 1))) == [Oversized(2**32 - 1, b"")]
    assert list(reader.feed(b"x" * 4096)) == []
    assert reader.pending_bytes == 0
