"""Bad arguments give ValueErrors that say what was wrong; the size parser and
TRAINSTREAM_HOST_ARENA_SLAB."""

from __future__ import annotations

import pytest
import torch
import ts_pinned
from ts_pinned import _arena, _core
from ts_pinned._sizes import parse_bytes


@pytest.fixture
def arena():
    return ts_pinned.PinnedArena(64 << 10)


@pytest.mark.parametrize("shape", [-1, (4, -2), [-3]])
def test_negative_sizes(arena, shape):
    with pytest.raises(ValueError, match="non-negative"):
        arena.empty(shape)


@pytest.mark.parametrize("shape", [2.0, (2, 3.0), "4", b"4", None, True, (True, 2), (2, None), [[2]]])
def test_non_int_shapes(arena, shape):
    with pytest.raises(ValueError, match="shape"):
        arena.empty(shape)


@pytest.mark.parametrize("dtype", ["float32", "torch.float32", float, None, 4])
def test_unknown_dtype(arena, dtype):
    with pytest.raises(ValueError, match=r"dtype must be a torch\.dtype"):
        arena.empty(4, dtype)


def test_bad_tag(arena):
    with pytest.raises(ValueError, match="tag"):
        arena.empty(4, torch.float32, tag=3)


def test_too_large(arena):
    with pytest.raises(ValueError, match="more than any host"):
        arena.empty((1 << 40, 1 << 30), torch.float32)
    # The native layer refuses sizes whose rounding would overflow.
    with pytest.raises(MemoryError, match="larger than any host"):
        _core.allocate(arena._arena, (1 << 64) - 1)
    assert arena.stats()["live_blocks"] == 0


def test_cap_below_reservation(arena):
    with pytest.raises(ValueError, match=r"cap .* below bytes_now"):
        arena.reserve(2 << 20, cap=1 << 20)
    with pytest.raises(ValueError, match=r"cap .* below bytes_now"):
        arena.reserve("2M", cap="1M")
    # The native check says the same to direct callers.
    with pytest.raises(ValueError, match=r"cap .* below bytes_now"):
        _core.Arena(4096, None).reserve(8192, 4096)
    assert arena.stats()["arena_bytes"] == 0


@pytest.mark.parametrize("slab", [0, "0", "0K", -1, "-1M"])
def test_zero_or_negative_slab(slab):
    with pytest.raises(ValueError, match="slab_bytes"):
        ts_pinned.PinnedArena(slab)
    with pytest.raises(ValueError, match="slab_bytes"):
        ts_pinned.PinnedArena(4096).set_slab_bytes(slab)


def test_native_rejects_zero_slab():
    with pytest.raises(ValueError, match="positive"):
        _core.Arena(0, None)
    with pytest.raises(ValueError, match="positive"):
        _core.Arena(4096, None).set_slab_bytes(0)


@pytest.mark.parametrize("call", ["reserve", "cap"])
def test_negative_reserve(arena, call):
    with pytest.raises(ValueError, match="negative"):
        if call == "reserve":
            arena.reserve(-1)
        else:
            arena.reserve(0, cap=-5)


@pytest.mark.parametrize("times", [2, 10**6])
def test_a_reservation_beyond_the_machine_is_refused_at_once(times):
    """Before: reserve("1T") page-locked slab after slab for minutes, and a size beyond the RAM "succeeded"
    where the kernel overcommits; now it is refused before any slab, naming what the machine has."""
    size = times * _core.host_memory()["available"]
    arena = ts_pinned.PinnedArena(1 << 20)
    with pytest.raises(ValueError, match=r"GiB available.*nothing was reserved"):
        arena.reserve(size)
    assert arena.stats()["arena_bytes"] == 0


def test_a_reservation_within_the_machine_still_happens(arena):
    assert arena.reserve("256K") >= 256 << 10
    assert arena.reserve("256K") >= 256 << 10  # what is reserved already counts: no refusal, nothing new


def test_negative_cap_in_constructor():
    with pytest.raises(ValueError, match="cap_bytes"):
        ts_pinned.PinnedArena(4096, cap_bytes=-1)


# ---- the size parser ------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        (0, 0),
        (123, 123),
        ("123", 123),
        ("1G", 1 << 30),
        ("1g", 1 << 30),
        ("512M", 512 << 20),
        ("64k", 64 << 10),
        ("64K", 64 << 10),
        ("1.5G", 3 << 29),
        ("0.5M", 1 << 19),
        ("2T", 2 << 40),
        (" 8 M ", 8 << 20),
        ("512MB", 512 << 20),
        ("1GiB", 1 << 30),
        ("100B", 100),
        ("1e3", 1000),
        ("123456789012345", 123456789012345),  # exact, no float rounding
    ],
)
def test_parse_bytes_accepts(text, expected):
    assert parse_bytes(text, "x") == expected


@pytest.mark.parametrize(
    "text", ["", " ", "G", "abc", "1Q", "1.2.3G", "inf", "-inf", "nan", "1e400", "0x10", "M1", "1 G B x"]
)
def test_parse_bytes_rejects_garbage(text):
    with pytest.raises(ValueError, match="is not a size"):
        parse_bytes(text, "TRAINSTREAM_HOST_ARENA_SLAB")


@pytest.mark.parametrize("value", [-1, "-1", "-2G", "-0.5K"])
def test_parse_bytes_rejects_negative(value):
    with pytest.raises(ValueError, match="negative"):
        parse_bytes(value, "x")


@pytest.mark.parametrize("value", [None, [1], True, object()])
def test_parse_bytes_rejects_other_types(value):
    with pytest.raises(ValueError, match="x"):
        parse_bytes(value, "x")


def test_parse_bytes_rejects_absurd_sizes():
    with pytest.raises(ValueError, match="larger than any host"):
        parse_bytes("99999999T", "x")
    with pytest.raises(ValueError, match="larger than any host"):
        parse_bytes(1 << 70, "x")


# ---- TRAINSTREAM_HOST_ARENA_SLAB --------------------------------------------------------


@pytest.fixture
def fresh_default(monkeypatch):
    """A default arena created anew under the test's environment, then restored."""
    monkeypatch.setattr(_arena, "_default", None)
    yield
    monkeypatch.setattr(_arena, "_default", None)


@pytest.mark.parametrize("value, expected", [("1G", 1 << 30), ("512M", 512 << 20), ("64k", 64 << 10),
                                             ("1.5G", 3 << 29), ("4096", 4096)])
def test_slab_env_var(monkeypatch, fresh_default, value, expected):
    monkeypatch.setenv("TRAINSTREAM_HOST_ARENA_SLAB", value)
    s = ts_pinned.pinned_stats()
    assert s["slab_bytes"] == expected
    assert s["arena_bytes"] == 0  # nothing is page-locked until asked


def test_slab_env_var_default(monkeypatch, fresh_default):
    monkeypatch.delenv("TRAINSTREAM_HOST_ARENA_SLAB", raising=False)
    assert ts_pinned.pinned_stats()["slab_bytes"] == 1 << 30


@pytest.mark.parametrize("value", ["lots", "1X", "", "0", "-1G", "inf"])
def test_bad_slab_env_var(monkeypatch, fresh_default, value):
    monkeypatch.setenv("TRAINSTREAM_HOST_ARENA_SLAB", value)
    with pytest.raises(ValueError, match="TRAINSTREAM_HOST_ARENA_SLAB"):
        ts_pinned.default_arena()


def test_reserve_pinned_on_default_arena(monkeypatch, fresh_default):
    monkeypatch.setenv("TRAINSTREAM_HOST_ARENA_SLAB", "64K")
    assert ts_pinned.reserve_pinned("100K", cap="1M", slab="32K") == 100 << 10
    s = ts_pinned.pinned_stats()
    assert s["slab_bytes"] == 32 << 10 and s["arena_cap"] == 1 << 20 and s["arena_slabs"] == 4
    t = ts_pinned.empty((10, 10), torch.float16, tag="kv")
    assert ts_pinned.pinned_stats()["by_tag"] == {"kv": 200}
    assert ts_pinned.default_arena() is ts_pinned.default_arena()
    del t
    with pytest.raises(ValueError, match="slab must not be negative"):
        ts_pinned.reserve_pinned(0, slab=-1)
