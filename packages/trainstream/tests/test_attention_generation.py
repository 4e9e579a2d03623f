"""The attention chooser and generation with a KV cache: calls whose keys outnumber their queries leave
cuDNN out (it builds a graph per new key length), measured or not. CPU tests; the GPU one is in
test_attention_cuda.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_attention import FLASH, MATH, Attention, fake_timer
from torch.nn.attention import SDPBackend, sdpa_kernel
from trainstream.attention import AttentionChooser, _measure
from trainstream.attention._measure import candidates


def test_cudnn_is_not_measured_for_a_growing_kv_cache():
    cuda = torch.device("cuda", 0)
    everything, _ = candidates(cuda, deterministic=False, warn_only=False)
    chosen, left = candidates(cuda, deterministic=False, warn_only=False, cached_keys=True)
    assert SDPBackend.CUDNN_ATTENTION in everything
    assert chosen == [b for b in everything if b != SDPBackend.CUDNN_ATTENTION]
    assert "new key length" in left["cudnn"]
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):  # the caller's only backend stays
        chosen, left = candidates(cuda, deterministic=False, warn_only=False, cached_keys=True)
        assert chosen == [SDPBackend.CUDNN_ATTENTION] and "cudnn" not in left


class Decode(torch.nn.Module):
    """Attention of the last position's query over every key: one decoding step's call shape."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q[:, :, -1:], k, v).sum()


@pytest.mark.parametrize("module, cached", [(Decode(), True), (Attention(), False)])
def test_the_chooser_says_when_the_keys_outnumber_the_queries(monkeypatch, module, cached):
    from trainstream.attention import _chooser

    seen = []

    def recording(device, deterministic, warn_only, *, cached_keys=False):
        seen.append(cached_keys)
        return candidates(device, deterministic, warn_only, cached_keys=cached_keys)

    monkeypatch.setattr(_chooser, "candidates", recording)
    chooser = AttentionChooser("auto", timer=fake_timer({"flash": 0.1, "math": 5.0}))
    chooser.install(module)
    module(torch.randn(2, 8, 32)).sum().backward()
    assert seen == [cached]


def test_generation_with_a_kv_cache_is_pinned_without_cudnn():
    from trainstream.attention._chooser import _Entry

    chooser = AttentionChooser("auto")
    module = Decode()
    chooser.install(module)
    with torch.no_grad():  # not measured: a generation forward
        module(torch.randn(2, 8, 32))
    (entry,) = chooser._entries.values()
    assert entry.cached_keys and not entry.complete and entry.pin is None  # on the CPU: PyTorch's own choice
    entry.device_type = "cuda"  # the same forward on a GPU
    pin = chooser._pin(entry)
    assert SDPBackend.CUDNN_ATTENTION not in pin and pin[-1] == MATH and len(pin) == len(_measure.priority_order()) - 1
    chooser._pin(entry)
    assert sum("not cuDNN" in e for e in chooser.events.lines()) == 1
    with sdpa_kernel([FLASH, MATH]):  # cuDNN already off: nothing to pin
        assert chooser._pin(entry) is None
    square = _Entry(train=False)
    square.device_type = "cuda"
    assert chooser._pin(square) is None  # keys no more than queries: PyTorch's own choice
