"""Invalid arguments are refused with the valid values named."""

from __future__ import annotations

import pytest
import torch
import ts_kvcache


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_layers": 0}, r"num_layers=0 must be an integer >= 1"),
        ({"num_layers": True}, r"num_layers=True must be an integer"),
        ({"num_layers": 2.0}, r"num_layers=2.0 must be an integer"),
        ({"max_tokens": 0}, r"max_tokens=0 must be an integer >= 1"),
        ({"page_tokens": 0}, r"page_tokens=0 must be an integer >= 1"),
        ({"vram_fraction": 0}, r"vram_fraction=0 must be a number in \(0, 1\]"),
        ({"vram_fraction": 1.5}, r"vram_fraction=1.5 must be a number in \(0, 1\]"),
        ({"vram_fraction": "half"}, r"vram_fraction='half'"),
        ({"resident_layers": "all"}, r'resident_layers=\'all\' is not valid; use "auto", an integer'),
        ({"resident_layers": 5}, r"resident_layers=5 is not valid; use \"auto\", an integer from 0 to 4"),
        ({"resident_layers": -1}, r"resident_layers=-1 is not valid"),
        ({"resident_layers": [0, 4]}, r"resident_layers entry=4 must be an integer between 0 and 3"),
        ({"resident_layers": [1, 1]}, r"names a layer twice"),
        ({"slots": 4}, r"slots=4 must be an integer between 2 and 3"),
        ({"copy": "dma"}, r"copy='dma' is not valid; use one of auto, engine, kernel"),
        ({"streams": "mine"}, r"streams='mine' must be None, a pair \(h2d, d2h\)"),
    ],
)
def test_constructor_refuses(kwargs, match):
    args = {"num_layers": 4, "max_tokens": 16, **kwargs}
    with pytest.raises(ValueError, match=match):
        ts_kvcache.PagedKVCache(**args)


def test_update_refuses_bad_tensors_and_layers():
    cache = ts_kvcache.PagedKVCache(2, 8, resident_layers=1)
    k = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match=r"layer=2 must be an integer between 0 and 1"):
        cache.update(2, k, k)
    with pytest.raises(ValueError, match=r"\[batch, kv_heads, new_tokens, head_dim\]"):
        cache.update(0, k[0], k[0])
    with pytest.raises(ValueError, match=r"values \(1, 2, 3, 5\)"):
        cache.update(0, k, torch.zeros(1, 2, 3, 5))
    with pytest.raises(ValueError, match=r"float64"):
        cache.update(0, k, k.double())
    with pytest.raises(ValueError, match="torch tensors"):
        cache.update(0, k, None)
    assert cache.seq_length(0) == 0  # nothing was half-applied


def test_a_new_batch_needs_a_reset():
    cache = ts_kvcache.PagedKVCache(2, 8, resident_layers=1, page_tokens=2)
    cache.update(0, torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 4))
    with pytest.raises(ValueError, match=r"holds batch 2, 1 kv heads, head_dim 4.*call reset\(\)"):
        cache.update(1, torch.zeros(3, 1, 1, 4), torch.zeros(3, 1, 1, 4))
    cache.reset()
    keys, _ = cache.update(1, torch.ones(3, 1, 1, 4), torch.ones(3, 1, 1, 4))
    assert keys.shape == (3, 1, 1, 4)
    cache.check_invariants()
