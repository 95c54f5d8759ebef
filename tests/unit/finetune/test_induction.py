"""finetune/train/init.py add_induction_head: a drafter grown by a hand-built induction head keeps
its function at alpha = 0 and, with the head on, drafts the token that followed the current token's
earlier occurrence."""

import pytest
import torch

from finetune.train.init import add_induction_head, fit_token_probe
from tests.helpers.models import tiny_drafter

# one KV group of two query heads, head_dim 32 (16 RoPE pairs), so the match has room
GEOMETRY = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32)


def tied_drafter():
    """A tiny drafter whose head is its embedding (tied, as SmolLM2's)."""
    drafter = tiny_drafter(**GEOMETRY)
    with torch.no_grad():
        drafter.lm_head.weight.copy_(drafter.embed_tokens.weight)
    return drafter


def _aux(drafter, ids: torch.Tensor) -> torch.Tensor:
    """Aux features that carry the token read at each position: [e(x); e(x); e(x)] -> [..., 3d]."""
    e = drafter.embed_tokens.weight[ids]
    return torch.cat([e, e, e], dim=-1)


def _probe(drafter):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 128, (16, 40), generator=gen)
    return fit_token_probe(drafter, _aux(drafter, ids), ids, torch.ones_like(ids, dtype=torch.bool))


def _repeat_sequence() -> torch.Tensor:
    """20 distinct tokens, then the first 10 again: x = a_0..a_19, a_0..a_9."""
    a = torch.randperm(123, generator=torch.Generator().manual_seed(2))[:20] + 5
    return torch.cat([a, a[:10]])


def _draft_logits(drafter, x: torch.Tensor) -> torch.Tensor:
    """First-draft logits at every position t (feature of x_t, input token x_{t+1}): [T-1, V]."""
    ids, feats = x[1:][None], drafter.fuse(_aux(drafter, x[:-1])[None])
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        return drafter.logits(drafter(ids, feats, pos))[0]


def test_probe_reads_the_token_off_the_feature():
    drafter = tiny_drafter(**GEOMETRY)
    M, top1 = _probe(drafter)
    assert M.shape == (32, 32)
    assert top1 > 0.95


def test_alpha_zero_keeps_the_drafter_and_grows_one_kv_group():
    drafter = tiny_drafter(**GEOMETRY)
    M, _ = _probe(drafter)
    grown = add_induction_head(drafter, M, alpha=0.0, num_pairs=8)
    assert (grown.config.num_attention_heads, grown.config.num_key_value_heads) == (4, 2)
    x = _repeat_sequence()
    torch.testing.assert_close(_draft_logits(grown, x), _draft_logits(drafter, x), atol=1e-5, rtol=1e-5)


def test_induction_head_drafts_the_token_after_the_earlier_occurrence():
    drafter = tied_drafter()
    M, _ = _probe(drafter)
    grown = add_induction_head(drafter, M, alpha=50.0, num_pairs=8)
    x = _repeat_sequence()
    before, after = _draft_logits(drafter, x).argmax(-1), _draft_logits(grown, x).argmax(-1)
    # positions t whose input x_{t+1} is a repeated a_k (k = 0..8): the copy is x_{t+2} = a_{k+1}
    ts = torch.arange(19, 28)
    want = x[ts + 2]
    assert (after[ts] == want).float().mean() >= 0.9
    assert (before[ts] == want).float().mean() <= 0.2


def test_num_pairs_out_of_range_is_refused():
    drafter = tiny_drafter(**GEOMETRY)
    with pytest.raises(ValueError, match="num_pairs 17 not in 1..16"):
        add_induction_head(drafter, torch.eye(32), num_pairs=17)


def test_low_rank_head_is_refused():
    drafter = tiny_drafter(head_rank=4, **GEOMETRY)
    with pytest.raises(ValueError, match="needs the dense head"):
        add_induction_head(drafter, torch.eye(32), num_pairs=8)


def test_several_groups_and_a_head_count_that_does_not_divide_the_width():
    drafter = tied_drafter()
    M, _ = _probe(drafter)
    grown = add_induction_head(drafter, M, alpha=50.0, num_pairs=8, num_groups=3)
    assert (grown.config.num_attention_heads, grown.config.num_key_value_heads) == (8, 4)
    x = _repeat_sequence()
    ts = torch.arange(19, 28)
    assert (_draft_logits(grown, x).argmax(-1)[ts] == x[ts + 2]).float().mean() >= 0.9
    with pytest.raises(ValueError, match="hidden size 32 is not a multiple of 6 attention heads"):
        add_induction_head(drafter, M, num_pairs=8, num_groups=2)
