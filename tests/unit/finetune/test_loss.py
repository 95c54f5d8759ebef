"""finetune/train/loss.py: KL, expected acceptance and top-1 on hand-computed cases."""

import math

import pytest
import torch

from finetune.train.loss import (
    expected_acceptance_terms,
    kl_terms,
    masked_mean,
    reference_rows,
    top1_agreement,
    ttt_weights,
)


def test_kl_half_half_vs_nine_one():
    ref = torch.tensor([0.5, 0.5]).log()
    draft = torch.tensor([0.9, 0.1]).log()
    # 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1) = 0.51083 nats (STYLE.md golden value)
    assert kl_terms(ref, draft).item() == pytest.approx(0.51083, abs=1e-5)


def test_kl_of_distribution_with_itself_is_zero():
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(kl_terms(logits, logits), torch.zeros(3), atol=1e-6)


def test_kl_trimmed_vocab_uses_unnormalised_reference_mass():
    ref = torch.tensor([0.1, 0.2, 0.3, 0.4]).log()  # target over V_t = 4
    draft = torch.tensor([0.25, 0.75]).log()  # draft rows map to target ids 1 and 3
    ids = torch.tensor([1, 3])
    expected = 0.2 * math.log(0.2 / 0.25) + 0.4 * math.log(0.4 / 0.75)
    assert kl_terms(ref, draft, ids).item() == pytest.approx(expected, abs=1e-6)


def test_expected_acceptance_is_sum_of_minimums():
    ref = torch.tensor([0.6, 0.3, 0.1]).log()
    draft = torch.tensor([0.2, 0.5, 0.3]).log()
    assert expected_acceptance_terms(ref, draft).item() == pytest.approx(0.2 + 0.3 + 0.1, abs=1e-6)
    # trimmed: draft mass on target ids 0 and 1 only
    trimmed = torch.tensor([0.5, 0.5]).log()
    assert expected_acceptance_terms(ref, trimmed, torch.tensor([0, 1])).item() == pytest.approx(
        0.8, abs=1e-6
    )


def test_top1_agreement_maps_draft_rows_to_target_ids():
    ref = torch.tensor([[0.0, 0.0, 5.0, 0.0]])
    draft = torch.tensor([[0.0, 3.0]])  # row 1 -> target id 2
    assert top1_agreement(ref, draft, torch.tensor([0, 2])).tolist() == [1.0]
    assert top1_agreement(ref, draft, torch.tensor([0, 3])).tolist() == [0.0]


def test_masked_mean_and_weights():
    v = torch.tensor([1.0, 2.0, 3.0, 4.0])
    m = torch.tensor([True, False, True, False])
    assert masked_mean(v, m).item() == pytest.approx(2.0)
    assert masked_mean(v, m, denom=4.0).item() == pytest.approx(1.0)
    assert ttt_weights(3, 0.8) == pytest.approx([1.0, 0.8, 0.64])


def test_reference_rows_kl_and_gradient_equal_kl_terms():
    g = torch.Generator().manual_seed(0)
    where = torch.tensor([[True, False, True], [False, True, True]])
    ref = torch.randn(4, 7, generator=g) * 3
    draft = torch.randn(3, 5, generator=g, requires_grad=True)
    ids = torch.tensor([0, 2, 3, 5, 6])  # a trimmed draft vocabulary: mass < 1
    rows = reference_rows(ref, where, ids)
    b, t = torch.tensor([1, 0, 1]), torch.tensor([2, 0, 1])  # rows 3, 0, 2
    kl = rows.kl(b, t, draft)
    (kl * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    grad, draft.grad = draft.grad.clone(), None
    expect = kl_terms(ref[[3, 0, 2]], draft, ids)
    (expect * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert torch.allclose(kl, expect, atol=1e-6)
    assert torch.allclose(grad, draft.grad, atol=1e-6)
    with pytest.raises(IndexError, match="not prepared"):
        rows.kl(torch.tensor([0]), torch.tensor([1]), draft[:1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_head_kl_equals_the_kl_of_the_head_logits(dtype):
    g = torch.Generator().manual_seed(1)
    where = torch.ones(2, 5, dtype=torch.bool)
    ids = torch.tensor([0, 2, 3, 5, 6, 8, 9])  # a trimmed draft vocabulary: mass < 1
    rows = reference_rows(torch.randn(10, 11, generator=g) * 3, where, ids)
    weight = torch.randn(7, 4, generator=g)
    x = torch.randn(9, 4, generator=g, requires_grad=True)
    b, t = torch.tensor([0, 1, 1, 0, 0, 1, 0, 1, 1]), torch.tensor([4, 0, 3, 1, 2, 2, 0, 4, 1])
    scale = torch.arange(1.0, 10.0)
    fused = rows.head_kl(b, t, x, weight.to(dtype), chunk=4)  # 3 chunks, the last one short
    (fused * scale).sum().backward()
    grad, x.grad = x.grad.clone(), None
    logits = x.to(dtype) @ weight.to(dtype).T
    expect = rows.kl(b, t, logits.float())
    (expect * scale).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(fused, expect, atol=tol, rtol=tol)
    assert torch.allclose(grad, x.grad, atol=tol, rtol=tol)
    assert grad.abs().sum() > 0
    with pytest.raises(IndexError, match="not prepared"):
        reference_rows(torch.randn(1, 11), torch.tensor([[True, False]]), ids).head_kl(
            torch.tensor([0]), torch.tensor([1]), x[:1], weight
        )
