"""Block top-k and max give torch.topk's values and torch.argmax's indices, ties and NaN included."""

import pytest
import torch

from slimspec_convert.model.vocab_pick import block_max, block_topk


def rows(kind: str, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "ties":  # few distinct values: many equal maxima, in many blocks
        return torch.randint(0, 5, shape, generator=g).float()
    return torch.randn(shape, generator=g)


@pytest.mark.parametrize("kind", ["random", "ties"])
@pytest.mark.parametrize("shape", [(1, 4096), (3, 2, 1024), (2, 1000)])  # 1000: not a multiple, torch's own
@pytest.mark.parametrize("k", [1, 4, 16])
def test_block_topk_has_torch_topk_values_and_indices_of_those_values(kind, shape, k):
    z = rows(kind, shape)
    values, idx = block_topk(z, k, block=64)
    ref = z.topk(k, dim=-1)
    assert values.shape == idx.shape == ref.values.shape
    assert torch.equal(values, ref.values)  # same values, descending
    assert torch.equal(z.gather(-1, idx), values)  # indices point at them
    assert all(len(set(r.tolist())) == k for r in idx.reshape(-1, k))  # k distinct entries
    if kind == "random":  # distinct values: the very same indices
        assert torch.equal(idx, ref.indices)


@pytest.mark.parametrize("kind", ["random", "ties"])
@pytest.mark.parametrize("shape", [(1, 4096), (3, 2, 1024), (2, 1000)])
def test_block_max_is_the_max_and_the_first_argmax(kind, shape):
    z = rows(kind, shape, seed=1)
    values, idx = block_max(z, block=64)
    assert torch.equal(values, z.amax(-1))
    assert torch.equal(idx, z.argmax(-1))  # the first maximal entry, ties included


def test_a_nan_is_picked_by_both_so_the_nan_watch_sees_it():
    z = torch.randn(2, 4096)
    z[1, 3000] = float("nan")
    values, idx = block_max(z)
    assert idx[1] == 3000 and torch.isnan(values[1]) and torch.isfinite(values[0])
    tv, ti = block_topk(z, 4)
    assert ti[1, 0] == 3000 and torch.isnan(tv[1, 0]) and torch.isfinite(tv[0]).all()


def test_k_larger_than_the_row_is_refused_as_torch_does():
    with pytest.raises(RuntimeError):
        block_topk(torch.randn(1, 128), 129)
