"""IpcHandle's byte format: every handle round-trips, anything else is refused by name."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ts_peer import IpcHandle

handles = st.builds(
    IpcHandle,
    kind=st.sampled_from(["cuda", "host"]),
    handle=st.binary(min_size=1, max_size=80),
    offset=st.integers(0, 2**64 - 1),
    nbytes=st.integers(0, 2**64 - 1),
    device=st.integers(-1, 2**31 - 1),
    pci_bus_id=st.text(max_size=20),
    pid=st.integers(0, 2**32 - 1),
)


@settings(max_examples=300, deadline=None)
@given(h=handles)
def test_round_trip(h):
    data = h.to_bytes()
    assert isinstance(data, bytes)
    assert IpcHandle.from_bytes(data) == h
    assert IpcHandle.from_bytes(bytearray(data)) == h


@settings(max_examples=100, deadline=None)
@given(h=handles, cut=st.integers(1, 30))
def test_truncated_or_padded_bytes_are_refused(h, cut):
    data = h.to_bytes()
    with pytest.raises(ValueError):
        IpcHandle.from_bytes(data[:-cut] if cut < len(data) else data[:1])
    with pytest.raises(ValueError, match="truncated or padded"):
        IpcHandle.from_bytes(data + b"\0" * cut)


def test_a_cuda_handle_keeps_its_64_bytes():
    raw = bytes(range(64))
    h = IpcHandle("cuda", raw, 4096, 1 << 30, 1, "0000:3b:00.0", 1234)
    back = IpcHandle.from_bytes(h.to_bytes())
    assert back.handle == raw and back.pci_bus_id == "0000:3b:00.0" and back.offset == 4096


def test_bad_bytes_and_fields_are_named():
    good = IpcHandle("host", b"/dev/shm/x", 0, 10).to_bytes()
    with pytest.raises(ValueError, match="bad magic"):
        IpcHandle.from_bytes(b"NOTPEER" + good[7:])
    with pytest.raises(ValueError, match="version 9"):
        IpcHandle.from_bytes(good[:6] + bytes([9]) + good[7:])
    with pytest.raises(ValueError, match="kind code 7"):
        IpcHandle.from_bytes(good[:7] + bytes([7]) + good[8:])
    with pytest.raises(ValueError, match="kind='nvlink'"):
        IpcHandle("nvlink", b"x", 0, 1)
    with pytest.raises(ValueError, match="offset=-1"):
        IpcHandle("host", b"x", -1, 1)
    with pytest.raises(ValueError, match="non-empty bytes"):
        IpcHandle("host", b"", 0, 1)
    with pytest.raises(ValueError, match="device=-2"):
        IpcHandle("cuda", b"x", 0, 1, device=-2)
