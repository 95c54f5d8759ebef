"""d2t / t2d helpers: hand-computed maps and every consistency rule (eagle3-formats.md section 4)."""

from __future__ import annotations

import pytest
import torch

from slimspec_convert.model.vocab import (
    VocabMapError,
    d2t_from_target_ids,
    draft_to_target_ids,
    scatter_to_target_vocab,
    t2d_from_d2t,
    trimmed_vocab_from_counts,
    validate_vocab_maps,
)


def test_d2t_offsets_map_draft_ids_to_target_ids():
    d2t = torch.tensor([0, 2, 5])
    assert draft_to_target_ids(d2t).tolist() == [0, 3, 7]  # i + d2t[i]
    assert t2d_from_d2t(d2t, 9).tolist() == [True, False, False, True, False, False, False, True, False]
    assert d2t_from_target_ids(torch.tensor([7, 0, 3])).tolist() == [0, 2, 5]  # sorted ascending first


def test_trimmed_vocab_keeps_most_frequent_ids_ties_by_lower_id():
    counts = torch.tensor([5, 0, 9, 9, 1, 0])
    d2t, t2d = trimmed_vocab_from_counts(counts, 3)
    assert draft_to_target_ids(d2t).tolist() == [0, 2, 3]  # counts 9, 9, 5
    assert t2d.tolist() == [True, False, True, True, False, False]
    d2t, _ = trimmed_vocab_from_counts(torch.tensor([0, 0, 4, 0]), 2)  # one seen id, padded with id 0
    assert draft_to_target_ids(d2t).tolist() == [0, 2]


def test_scatter_places_row_i_at_target_id_i_plus_d2t():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    full = scatter_to_target_vocab(logits, torch.tensor([0, 2, 5]), 9)
    assert full[0, [0, 3, 7]].tolist() == [1.0, 2.0, 3.0]
    assert torch.isinf(full[0, [1, 2, 4, 5, 6, 8]]).all()
    assert scatter_to_target_vocab(logits, None, 3) is logits


def test_validate_accepts_consistent_maps():
    d2t = torch.tensor([0, 2, 5])
    validate_vocab_maps(d2t, t2d_from_d2t(d2t, 9), 3, 9)
    validate_vocab_maps(d2t.to(torch.int32), None, 3, 9)  # nebius-style int32 offsets are fine
    validate_vocab_maps(None, None, 9, 9)


@pytest.mark.parametrize(
    "d2t,t2d,vd,v,match",
    [
        (None, None, 3, 9, r"draft_vocab_size=3 < vocab_size=9 but no 'd2t'"),
        ([0, 2, 7], None, 3, 9, r"target ids in \[0, 9\], outside \[0, vocab_size=9\)"),
        ([0, 3, 9], None, 3, 9, r"absolute id table"),
        ([0, 0, -1], None, 3, 9, r"maps 1 draft ids onto a target id already used"),
        ([0, 2], None, 3, 9, r"'d2t' has shape \(2,\), expected \[draft_vocab_size=3\]"),
        ([0, 2, 5], [1, 0, 0, 1, 0, 0, 0, 0, 1], 3, 9, r"'t2d' and 'd2t' disagree"),
        ([0, 2, 5], [1, 0, 0, 1, 0, 0, 0, 1, 1], 3, 9, r"t2d.sum\(\)=4 != draft_vocab_size=3"),
    ],
)
def test_validate_refuses_broken_maps(d2t, t2d, vd, v, match):
    d2t = None if d2t is None else torch.tensor(d2t)
    t2d = None if t2d is None else torch.tensor(t2d, dtype=torch.bool)
    with pytest.raises(VocabMapError, match=match):
        validate_vocab_maps(d2t, t2d, vd, v, where="x.safetensors")


def test_validate_refuses_float_d2t_and_int_t2d():
    with pytest.raises(VocabMapError, match="expected an integer type"):
        validate_vocab_maps(torch.tensor([0.0, 2.0]), None, 2, 5)
    with pytest.raises(VocabMapError, match="expected bool"):
        validate_vocab_maps(torch.tensor([0, 2]), torch.tensor([1, 0, 1, 0, 0]), 2, 5)
    with pytest.raises(VocabMapError, match="duplicates"):
        d2t_from_target_ids(torch.tensor([3, 1, 3]))
