"""NCCL's packed version numbers, read without NCCL (kvd.transport.nccl.version_at_least):
blocking calls need 2.28 or later."""

from __future__ import annotations

from kvd.transport.nccl import BLOCKING_CALLS_MIN_NCCL, version_at_least


def test_packed_versions_both_encodings() -> None:
    assert version_at_least(22809, "2.28")  # 2.28.9, X*10000 + Y*100 + Z
    assert version_at_least(23000, "2.28")
    assert not version_at_least(22703, "2.28")
    assert not version_at_least(2708, "2.28")  # 2.7.8, the encoding before 2.9
    assert version_at_least(31000, "2.28")


def test_the_minimum_is_the_version_the_probes_ran_on() -> None:
    assert BLOCKING_CALLS_MIN_NCCL == "2.28"
    assert version_at_least(22809, BLOCKING_CALLS_MIN_NCCL)
