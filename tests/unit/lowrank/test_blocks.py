"""``same_rows``: the row-block table comparison convert uses to record a tied head (head_is_embedding)."""

from __future__ import annotations

import torch

from slimspec_convert.lowrank.blocks import same_rows


def test_same_rows_compares_in_the_coarser_dtype_and_tolerates_nothing_else():
    g = torch.Generator().manual_seed(0)
    E = torch.randn(300, 8, generator=g)  # fp32 embedding
    assert same_rows(E, E.clone(), block_rows=64)
    assert same_rows(E.to(torch.bfloat16), E, block_rows=64)  # a bf16 copy of the table is the table
    assert same_rows(E, E.to(torch.bfloat16), block_rows=64)
    changed = E.clone()
    changed[257, 3] += 1e-3  # one entry, in the last block
    assert not same_rows(changed, E, block_rows=64)
    assert not same_rows(E[:299], E)  # another shape
    assert not same_rows(E.to(torch.bfloat16), E + 0.05)  # bf16 rounding does not hide a real difference
