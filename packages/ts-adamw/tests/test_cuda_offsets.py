"""Offsets on the GPU: a tensor updated in pieces by cuda_adamw_step or CudaAdamWBatch, each piece with the whole
tensor's key and its offset, gets bit for bit the bf16 moments and weights of one update of the whole, and the
bits of the host engine (adamw_steps) over the whole, also where a 4096-element tile straddles a 2**32 rounding
window. Needs ts_adamw built with CUDA and a GPU."""

from __future__ import annotations

import itertools

import pytest
import torch
import ts_adamw
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not (ts_adamw.built_with_cuda and torch.cuda.is_available()),
                                                   reason="needs ts_adamw built with CUDA and a GPU")]

KW = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.05}
WINDOW = 1 << 32
# 0; a window boundary 904 elements into the whole's second tile; one not on a tile boundary further in.
BASES = [0, WINDOW - 5000, 3 * WINDOW - 4097]


def random_pieces(test):
    """A tensor of n values whose rounding stream starts at `base`, cut where `data` draws (see _bounds)."""
    return settings(max_examples=10, deadline=None)(given(
        n=st.integers(2, 40_000), data=st.data(), key=st.integers(0, 2**32 - 1), seed=st.integers(0, 2**32 - 1),
        base=st.sampled_from(BASES))(test))


def _state(n, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    param = torch.randn(n, generator=g).to(device)
    grads = [torch.randn(n, generator=g).to(device, torch.bfloat16) for _ in range(3)]
    m = torch.zeros(n, dtype=torch.bfloat16, device=device)
    v = torch.zeros(n, dtype=torch.bfloat16, device=device)
    out = torch.zeros(n, dtype=torch.bfloat16, device=device)
    return param, grads, m, v, out


def _clone(state, device="cuda"):
    param, grads, m, v, out = state
    return (param.to(device, copy=True), [g.to(device, copy=True) for g in grads], m.to(device, copy=True),
            v.to(device, copy=True), out.to(device, copy=True))


def _bounds(n, cuts):
    edges = [0, *sorted(set(cuts)), n]
    return [(lo, hi) for lo, hi in itertools.pairwise(edges) if hi > lo]


def _views(state, bounds):
    param, _, m, v, out = state
    return tuple([t[lo:hi] for lo, hi in bounds] for t in (param, m, v, out))


def _host_whole(state, key, base, seed):
    """The host engine over the whole tensor (CPU copies), three steps."""
    param, grads, m, v, out = _clone(state, "cpu")
    for step, g in enumerate(grads, 1):
        ts_adamw.adamw_steps([param], [g], [m], [v], params_out=[out], seed=seed, keys=[key], offsets=[base],
                             step=step, **KW)
    return param, m, v, out


def _assert_bits(state, reference):
    param, _, m, v, out = state
    for ours, theirs in zip((param, m, v, out), reference):
        assert torch.equal(ours.cpu(), theirs.cpu())


@random_pieces
def test_cuda_pieces_write_the_bits_of_the_whole_on_the_gpu_and_on_the_host(n, data, key, seed, base):
    bounds = _bounds(n, data.draw(st.lists(st.integers(1, n - 1), min_size=1, max_size=6)))
    whole = _state(n, "cuda")
    pieces = _clone(whole)
    host = _host_whole(whole, key, base, seed)
    for step in (1, 2, 3):
        g = whole[1][step - 1]
        ts_adamw.cuda_adamw_step([whole[0]], [g], [whole[2]], [whole[3]], params_out=[whole[4]], seed=seed,
                                 keys=[key], offsets=[base], step=step, **KW)
        ps, ms, vs, outs = _views(pieces, bounds)
        gs = [pieces[1][step - 1][lo:hi] for lo, hi in bounds]
        ts_adamw.cuda_adamw_step(ps, gs, ms, vs, params_out=outs, seed=seed, keys=[key] * len(bounds),
                                 offsets=[base + lo for lo, _ in bounds], step=step, **KW)
    torch.cuda.synchronize()
    _assert_bits(whole, host)
    _assert_bits(pieces, host)


@random_pieces
def test_a_prepared_batch_of_pieces_writes_the_bits_of_the_whole(n, data, key, seed, base):
    """The offsets given at construction stay with the batch for every step."""
    bounds = _bounds(n, data.draw(st.lists(st.integers(1, n - 1), min_size=1, max_size=6)))
    pieces = _state(n, "cuda")
    host = _host_whole(pieces, key, base, seed)
    ps, ms, vs, outs = _views(pieces, bounds)
    batch = ts_adamw.CudaAdamWBatch(ps, ms, vs, params_out=outs, keys=[key] * len(bounds),
                                    offsets=[base + lo for lo, _ in bounds], grad_dtypes=[torch.bfloat16] * len(bounds))
    for step, g in enumerate(pieces[1], 1):
        batch.step([g[lo:hi] for lo, hi in bounds], seed=seed, step=step, **KW)
    torch.cuda.synchronize()
    _assert_bits(pieces, host)


def test_a_tile_across_a_window_boundary_rounds_as_the_host():
    """One tensor of 3 tiles whose indices cross 2**32 inside the middle tile (aligned, vectorized path) and
    an unaligned piece across the same boundary (scalar path)."""
    whole = _state(3 * 4096, "cuda", seed=4)
    piece = _clone(whole)
    base = WINDOW - 4096 - 1000
    host = _host_whole(whole, 11, base, 2)
    for step, g in enumerate(whole[1], 1):
        ts_adamw.cuda_adamw_step([whole[0]], [g], [whole[2]], [whole[3]], params_out=[whole[4]], seed=2, keys=[11],
                                 offsets=[base], step=step, **KW)
    bounds = [(0, 4097), (4097, 3 * 4096)]  # the second piece starts unaligned, 999 before the boundary
    for step, g in enumerate(piece[1], 1):
        ps, ms, vs, outs = _views(piece, bounds)
        ts_adamw.cuda_adamw_step(ps, [g[lo:hi] for lo, hi in bounds], ms, vs, params_out=outs, seed=2, keys=[11, 11],
                                 offsets=[base, base + 4097], step=step, **KW)
    torch.cuda.synchronize()
    _assert_bits(whole, host)
    _assert_bits(piece, host)


def test_without_offsets_gpu_pieces_round_differently():
    """Not vacuous: the same pieces without their offsets draw other bits than the whole."""
    whole = _state(10_000, "cuda")
    pieces = _clone(whole)
    ts_adamw.cuda_adamw_step([whole[0]], [whole[1][0]], [whole[2]], [whole[3]], keys=[3], seed=1, step=1, **KW)
    bounds = [(0, 4000), (4000, 10_000)]
    ps, ms, vs, _ = _views(pieces, bounds)
    ts_adamw.cuda_adamw_step(ps, [pieces[1][0][lo:hi] for lo, hi in bounds], ms, vs, keys=[3, 3], seed=1, step=1,
                             **KW)
    torch.cuda.synchronize()
    assert torch.equal(whole[2][:4000], pieces[2][:4000])
    assert not torch.equal(whole[2][4000:], pieces[2][4000:])


@pytest.mark.parametrize("offsets", [[0], [0, -1], [0, 2**62 + 1], [0, 1.0], [0, True]])
def test_bad_offsets_are_refused_on_the_gpu(offsets):
    state = _state(8, "cuda")
    before = _clone(state)
    bounds = [(0, 4), (4, 8)]
    ps, ms, vs, outs = _views(state, bounds)
    with pytest.raises(ValueError, match="offsets"):
        ts_adamw.cuda_adamw_step(ps, [state[1][0][:4], state[1][0][4:]], ms, vs, params_out=outs, offsets=offsets,
                                 step=1, **KW)
    with pytest.raises(ValueError, match="offsets"):
        ts_adamw.CudaAdamWBatch(ps, ms, vs, params_out=outs, offsets=offsets)
    torch.cuda.synchronize()
    _assert_bits(state, (before[0], before[2], before[3], before[4]))
