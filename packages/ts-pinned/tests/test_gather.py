"""ts_pinned.gather_rows: the GPU reads looked-up rows of a page-locked host table over the link. Against
torch's own lookup, for wide (16-byte) and narrow rows, ids of any integer type; out-of-range ids flagged."""

import pytest
import torch
import ts_pinned
from hypothesis import given, settings
from hypothesis import strategies as st


def test_arguments_are_checked_before_the_gpu_is_touched():
    table = torch.zeros(4, 3)
    with pytest.raises(ValueError, match=r"out must be contiguous torch.float32 of shape \(2, 3\)"):
        ts_pinned.gather_rows(table, torch.zeros(2, dtype=torch.int64), torch.zeros(2, 4),
                              torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="ids must be integers"):
        ts_pinned.gather_rows(table, torch.zeros(2), torch.zeros(2, 3), torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous 2-D"):
        ts_pinned.gather_rows(torch.zeros(4), torch.zeros(2, dtype=torch.int64), torch.zeros(2, 3),
                              torch.zeros(1, dtype=torch.int32))




@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 300), cols=st.integers(1, 70), n=st.integers(0, 64),
       dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.uint8]),
       id_dtype=st.sampled_from([torch.int64, torch.int32]), seed=st.integers(0, 2**31 - 1))
def test_cuda_rows_match_torch_for_any_width_and_id_type(rows, cols, n, dtype, id_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    table = torch.randint(0, 255, (rows, cols), generator=gen).to(dtype).pin_memory()
    ids = torch.randint(0, rows, (n,), generator=gen).to(id_dtype).cuda()
    bad = torch.zeros(1, dtype=torch.int32).pin_memory()
    out = torch.full((n, cols), 7, dtype=dtype, device="cuda")
    ts_pinned.gather_rows(table, ids, out, bad)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), table[ids.cpu().long()]) and int(bad) == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_out_of_range_ids_give_zero_rows_and_the_flag():
    table = torch.arange(40, dtype=torch.bfloat16).view(5, 8).pin_memory()
    bad = torch.zeros(1, dtype=torch.int32).pin_memory()
    ids = torch.tensor([[0, 5], [-1, 4]], device="cuda")
    out = ts_pinned.gather_rows(table, ids, torch.empty(2, 2, 8, dtype=torch.bfloat16, device="cuda"), bad)
    torch.cuda.synchronize()
    assert int(bad) == 1
    assert torch.equal(out[0, 0].cpu(), table[0]) and torch.equal(out[1, 1].cpu(), table[4])
    assert not out[0, 1].any() and not out[1, 0].any()
    with pytest.raises(ValueError, match="page-locked host memory"):
        ts_pinned.gather_rows(torch.zeros(5, 8), ids, torch.empty(2, 2, 8, device="cuda"), bad)
