"""LowRankHead: the function it computes, its key names (TorchSpec PR #185 layout) and its swap-in."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slimspec_convert.lowrank.svd import lowrank_factorize
from slimspec_convert.model.head import LowRankHead, head_rank, make_head
from tests.helpers.models import tiny_drafter


def test_lowrank_head_computes_w_up_w_down_h():
    head = LowRankHead(hidden_size=3, vocab_rows=4, rank=2)
    with torch.no_grad():
        head.down.weight.copy_(torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, -1.0]]))  # W_down [2, 3]
        head.up.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, -1.0]]))  # W_up [4, 2]
    h = torch.tensor([[1.0, 2.0, 3.0]])
    # W_down h = [1 + 6, 2 - 3] = [7, -1]; W_up [7, -1] = [7, -1, 6, 15]
    assert head(h).tolist() == [[7.0, -1.0, 6.0, 15.0]]
    assert (head.rank, head.in_features, head.out_features) == (2, 3, 4)
    assert sorted(head.state_dict()) == ["down.weight", "up.weight"]


def test_from_factorization_copies_factors_and_matches_dense_at_full_rank():
    W = torch.randn(12, 5, generator=torch.Generator().manual_seed(0))
    head = LowRankHead.from_factorization(lowrank_factorize(W, 5))
    h = torch.randn(3, 5, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(head(h), h @ W.T, atol=1e-5)


def test_make_head_and_rank_validation():
    assert isinstance(make_head(8, 16, None), nn.Linear) and head_rank(make_head(8, 16, None)) is None
    assert head_rank(make_head(8, 16, 4)) == 4
    with pytest.raises(ValueError, match=r"rank r=9 is outside \[1, min\(V_d=16, d=8\)\]"):
        LowRankHead(8, 16, 9)
    with pytest.raises(ValueError, match=r"rank r=0"):
        LowRankHead(8, 16, 0)


def test_lowrank_drafter_keys_and_logits():
    drafter = tiny_drafter(head_rank=4, draft_vocab_size=64)
    keys = set(drafter.state_dict())
    assert {"lm_head.down.weight", "lm_head.up.weight"} <= keys and "lm_head.weight" not in keys
    assert drafter.state_dict()["lm_head.down.weight"].shape == (4, 32)
    assert drafter.state_dict()["lm_head.up.weight"].shape == (64, 4)
    h = torch.randn(1, 2, 32, generator=torch.Generator().manual_seed(2))
    W_up, W_down = drafter.lm_head.up.weight, drafter.lm_head.down.weight
    expected = drafter.norm(h) @ W_down.T @ W_up.T  # logits = W_up (W_down norm(h))
    assert torch.allclose(drafter.logits(h), expected, atol=1e-6)
