"""stream_triad / stream_rmw: the host bandwidth kernels compute what they claim and refuse bad buffers."""

from __future__ import annotations

import pytest
import torch
from ts_adamw import _core


def _rand(n, seed):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [0, 1, 17, 1000, 300_001])
@pytest.mark.parametrize("nontemporal", [False, True])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_triad_matches_torch(n, nontemporal, offset):
    # offset makes `a` start off a cache line / vector boundary (the streaming-store head path).
    a = torch.full((n + offset,), float("nan"))[offset:]
    b, c = _rand(n, 1), _rand(n, 2)
    seconds = _core.stream_triad(a, b, c, 2.5, nontemporal=nontemporal)
    assert seconds >= 0.0
    s = torch.tensor(2.5, dtype=torch.float32)
    assert torch.equal(a, b + s * c)


@pytest.mark.parametrize("threads", [0, 1, 2])
def test_triad_thread_counts_agree(threads):
    n = 200_000
    a, b, c = torch.empty(n), _rand(n, 3), _rand(n, 4)
    _core.stream_triad(a, b, c, -0.75, threads=threads)
    assert torch.equal(a, b + torch.tensor(-0.75) * c)


@pytest.mark.parametrize("n", [0, 5, 250_003])
def test_rmw_matches_torch(n):
    p, g, m, v = (_rand(n, s) for s in range(4))
    ref = [t.clone() for t in (p, g, m, v)]
    s = torch.tensor(1e-3, dtype=torch.float32)
    assert _core.stream_rmw(p, g, m, v, 1e-3) >= 0.0
    assert torch.equal(p, ref[0] + s * ref[1])
    assert torch.equal(m, ref[2] + s * ref[1])
    assert torch.equal(v, ref[3] + s * ref[0])
    assert torch.equal(g, ref[1])


def test_bad_buffers_raise_value_error():
    n = 64
    a, b, c = torch.full((n,), float("nan")), torch.ones(n), torch.ones(n)
    with pytest.raises(ValueError, match="float32"):
        _core.stream_triad(a, b.double(), c, 1.0)
    with pytest.raises(ValueError, match="bfloat16"):
        _core.stream_triad(a.bfloat16(), b, c, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        _core.stream_triad(a, torch.ones(2 * n)[::2], c, 1.0)
    with pytest.raises(ValueError, match="element count"):
        _core.stream_triad(a, b, torch.ones(n + 1), 1.0)
    with pytest.raises(ValueError, match="overlap"):
        _core.stream_triad(a, a, c, 1.0)
    big = torch.ones(2 * n)
    with pytest.raises(ValueError, match="overlap"):
        _core.stream_triad(big[: n], big[n // 2: n + n // 2], c, 1.0)
    with pytest.raises(ValueError, match="threads"):
        _core.stream_triad(a, b, c, 1.0, threads=-1)
    with pytest.raises(ValueError, match="finite"):
        _core.stream_triad(a, b, c, float("inf"))
    with pytest.raises(ValueError, match="overlap"):
        _core.stream_rmw(a, b, a, c, 1.0)
    with pytest.raises(ValueError, match="element count"):
        _core.stream_rmw(a, b, c, torch.ones(n - 1), 1.0)
    with pytest.raises(TypeError):
        _core.stream_triad(a, b, [1.0] * n, 1.0)
    # Nothing was written by the refused calls.
    assert torch.isnan(a).all() and torch.equal(b, torch.ones(n)) and torch.equal(c, torch.ones(n))


def test_adjacent_buffers_are_not_overlapping():
    n = 100
    big = torch.zeros(3 * n)
    a, b, c = big[:n], big[n: 2 * n], big[2 * n:]
    b.fill_(1.0)
    c.fill_(2.0)
    _core.stream_triad(a, b, c, 0.5)
    assert torch.equal(a, torch.full((n,), 2.0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_buffers_are_refused():
    a = torch.empty(8, device="cuda")
    with pytest.raises(ValueError, match="CPU"):
        _core.stream_triad(a, torch.ones(8), torch.ones(8), 1.0)
