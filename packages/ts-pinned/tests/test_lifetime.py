"""Tensor lifetime: blocks return when the last view dies, data stays intact,
threads, and tensors that outlive their arena object."""

from __future__ import annotations

import gc
import random
import threading

import pytest
import torch
import ts_pinned
from ts_pinned import _core


def _has_numpy() -> bool:
    try:
        import numpy  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture
def arena():
    a = ts_pinned.PinnedArena(1 << 20)
    a.reserve(1 << 20)
    yield a
    gc.collect()
    a.check_invariants()


def test_freed_tensor_returns_its_block(arena):
    t = arena.empty((1000,), torch.float32, "x")
    s = arena.stats()
    assert s["arena_used"] == 4096 and s["live_blocks"] == 1 and s["by_tag"] == {"x": 4000}
    ptr = t.data_ptr()
    del t
    s = arena.stats()
    assert s["arena_used"] == 0 and s["live_blocks"] == 0 and s["by_tag"] == {}
    assert s["arena_largest_free"] == 1 << 20
    # Best fit from a coalesced slab: the same block comes back.
    assert arena.empty((1000,), torch.float32).data_ptr() == ptr


@pytest.mark.parametrize(
    "make_view",
    [
        lambda t: t[10:20],
        lambda t: t[::3],
        lambda t: t.view(10, 100),
        lambda t: t.view(torch.uint8),
        lambda t: t.reshape(2, 500).t(),
        lambda t: t.as_strided((5,), (7,), 3),
        lambda t: t.unsqueeze(0).expand(4, -1),
        pytest.param(lambda t: t.numpy(), marks=pytest.mark.skipif(not _has_numpy(), reason="needs numpy")),
    ],
    ids=["slice", "step", "view", "dtype", "transpose", "as_strided", "expand", "numpy"],
)
def test_views_keep_the_block_alive(arena, make_view):
    t = arena.empty(1000, torch.float32)
    t.copy_(torch.arange(1000, dtype=torch.float32))
    expected = torch.as_tensor(make_view(t.clone())).clone()
    v = make_view(t)
    del t
    gc.collect()
    assert arena.stats()["arena_used"] == 4096
    # Reuse pressure: anything freed would be handed out again and overwritten.
    others = [arena.empty(1000, torch.float32).fill_(-1.0) for _ in range(10)]
    assert torch.equal(torch.as_tensor(v), expected)
    del others
    del v
    gc.collect()
    assert arena.stats()["arena_used"] == 0


def test_data_intact_while_others_come_and_go(arena, helpers):
    random_bytes = helpers.random_bytes
    keep = [arena.empty(n, torch.uint8) for n in (1, 513, 4096, 70_000)]
    for i, t in enumerate(keep):
        t.copy_(random_bytes(t.numel(), seed=i))
    rng = random.Random(0)
    churn = []
    for step in range(400):
        if churn and rng.random() < 0.45:
            churn.pop(rng.randrange(len(churn)))
        else:
            churn.append(arena.empty(rng.randint(1, 30_000), torch.uint8).fill_(step % 256))
    for i, t in enumerate(keep):
        assert torch.equal(t, random_bytes(t.numel(), seed=i))
    del churn
    arena.check_invariants()
    assert arena.stats()["live_blocks"] == len(keep)


def test_many_threads_allocate_and_free_at_once():
    arena = ts_pinned.PinnedArena(64 << 10, cap_bytes=2 << 20)
    errors = []
    barrier = threading.Barrier(8)

    def worker(seed):
        try:
            rng = random.Random(seed)
            mine = []
            barrier.wait()
            for _ in range(300):
                if mine and rng.random() < 0.5:
                    t, value = mine.pop(rng.randrange(len(mine)))
                    assert bool((t == value).all()), "another thread wrote into my block"
                else:
                    n = rng.choice([1, 100, 5000, 40_000, 300_000])  # the last ones overflow the cap
                    value = rng.randrange(256)
                    mine.append((arena.empty(n, torch.uint8, tag=f"t{seed % 3}").fill_(value), value))
            for t, value in mine:
                assert bool((t == value).all())
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    arena.check_invariants()
    s = arena.stats()
    assert s["arena_used"] == 0 and s["live_blocks"] == 0 and s["fallback_bytes"] == 0 and s["by_tag"] == {}
    assert s["arena_bytes"] <= 2 << 20
    assert s["arena_fallbacks"] > 0


def test_tensor_outlives_its_arena_object():
    a = ts_pinned.PinnedArena(1 << 20)
    t = a.empty(10_000, torch.int64)
    view = t[5000:]
    t.copy_(torch.arange(10_000))
    del a
    gc.collect()
    # The arena the block belongs to must still exist: churn other memory and check.
    b = ts_pinned.PinnedArena(1 << 20)
    junk = [b.empty(20_000, torch.int64).fill_(-7) for _ in range(5)]
    junk2 = [torch.full((20_000,), -9, dtype=torch.int64) for _ in range(20)]
    assert torch.equal(t, torch.arange(10_000))
    del t
    gc.collect()
    assert torch.equal(view, torch.arange(5000, 10_000))
    view.fill_(3)  # writing to a block of a dropped arena is fine while the view lives
    del view, junk, junk2
    gc.collect()


def test_arena_dropped_first_exits_cleanly(helpers):
    # Tensors still alive at interpreter exit, some of a dropped arena: no crash,
    # and no leak warnings from nanobind on stderr.
    proc = helpers.run_python(
        """
        import torch, ts_pinned
        a = ts_pinned.PinnedArena(1 << 20)
        t = a.empty(1000, torch.float32).fill_(1.0)
        del a
        u = ts_pinned.empty(100)
        w = ts_pinned.PinnedArena(1 << 20).empty(10)
        print(float(t.sum()))
        """
    )
    assert proc.stdout.strip() == "1000.0"
    assert "leak" not in proc.stderr, proc.stderr


def test_block_is_pinned_matches_stats(arena):
    t = arena.empty(100)
    assert _core.block_is_pinned(arena._arena, t.data_ptr()) == arena.stats()["pinned"]
    assert not _core.block_is_pinned(arena._arena, 12345)


def test_zero_size_tensors_use_no_block(arena):
    for shape in [0, (0,), (3, 0), (0, 5, 2)]:
        t = arena.empty(shape, torch.float32)
        assert t.numel() == 0 and tuple(t.shape) == ((shape,) if isinstance(shape, int) else shape)
    assert arena.stats()["live_blocks"] == 0


def test_scalar_and_shape_forms(arena):
    np = pytest.importorskip("numpy")

    assert arena.empty((), torch.float64).shape == ()
    assert arena.empty(torch.Size([2, 3])).shape == (2, 3)
    assert arena.empty([np.int64(4), 2], torch.int8).shape == (4, 2)
    assert arena.empty(np.int32(7)).shape == (7,)


def test_trim_returns_only_wholly_free_slabs_and_live_blocks_keep_their_bytes():
    arena = ts_pinned.PinnedArena(slab_bytes=64 << 10)
    arena.reserve(3 * (64 << 10))
    held = arena.empty(1000, torch.uint8, tag="held")  # carved from one slab
    held.copy_(torch.arange(1000) % 251)
    released = arena.trim()
    s = arena.stats()
    assert released == 2 * (64 << 10)
    assert s["arena_bytes"] == 64 << 10 and s["arena_slabs"] == 1 and s["arena_used"] > 0
    assert torch.equal(held, (torch.arange(1000) % 251).to(torch.uint8))
    assert arena.trim() == 0  # the slab in use stays
    again = arena.empty(200 << 10, torch.uint8)  # a trimmed slot is reused for the new slab
    assert arena.stats()["arena_slabs"] == 2
    arena.check_invariants()
    del held, again
    assert arena.trim(keep_bytes=64 << 10) > 0 and arena.stats()["arena_bytes"] <= 64 << 10
    with pytest.raises(ValueError):
        arena.trim(-1)


def test_trim_keeps_a_slab_whose_only_free_range_starts_at_zero():
    """A block at a slab's end with the start free: one free range at offset 0, not the whole slab."""
    arena = ts_pinned.PinnedArena(slab_bytes=64 << 10)
    first = arena.empty(16 << 10, torch.uint8)
    last = arena.empty(48 << 10, torch.uint8)  # fills the slab to its end
    last.fill_(7)
    del first
    assert arena.trim() == 0
    assert arena.stats()["arena_bytes"] == 64 << 10
    assert bool((last == 7).all())
    arena.check_invariants()


def test_is_pinned_names_arena_blocks_only():
    arena = ts_pinned.PinnedArena(slab_bytes=64 << 10)
    t = arena.empty(4096, torch.uint8)
    assert arena.is_pinned(t) == arena.stats()["pinned"]
    assert arena.is_pinned(t[100:]) == arena.stats()["pinned"]  # a view: its block is found by storage
    assert not arena.is_pinned(torch.empty(4096, dtype=torch.uint8))
