"""Converting against the real SmolLM2-135M-Instruct target folder (tied head: the added rows are
embedding rows)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from slimspec_convert.checkpoint.load import load_drafter
from slimspec_convert.model.vocab import draft_to_target_ids
from slimspec_convert.workflows.convert import ConvertConfig, convert
from tests.helpers.eagle3_layouts import write_layout
from tests.helpers.models import read_tensors, smollm2_drafter_config


@pytest.mark.integration
def test_full_vocab_with_the_real_tied_smollm2_target(smollm2_path, tmp_path):
    """A SmolLM2-shaped trimmed drafter (V_d 8192 of 49152) against the real target folder.

    SmolLM2 ties its head to the embedding, so the added rows must be rows of
    ``model.embed_tokens.weight`` (read with the safetensors library as the reference).
    """
    from slimspec_convert.model.drafter import Eagle3Drafter
    from slimspec_convert.model.vocab import trimmed_vocab_from_counts

    torch.manual_seed(0)
    cfg = smollm2_drafter_config(head_dim=None, draft_vocab_size=8192, aux_layer_ids=(2, 15, 27))
    drafter = Eagle3Drafter(cfg)
    d2t, t2d = trimmed_vocab_from_counts(torch.randint(0, 1000, (49152,)), 8192)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    src = write_layout(drafter, "specforge", tmp_path / "src")
    cfg = ConvertConfig(rank=576, target=str(smollm2_path), full_vocab=True, calibrate=False)  # plain SVD
    rep = convert(src, tmp_path / "out", cfg)
    assert (rep.vocab_size, rep.target_rows_added, rep.svd_method) == (49152, 40960, "exact")
    out = read_tensors(tmp_path / "out")
    head = out["lm_head.up.weight"] @ out["lm_head.down.weight"]  # full rank: the assembled head
    with safe_open(str(smollm2_path / "model.safetensors"), framework="pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight").float()
    assert torch.allclose(head[~t2d], embed[~t2d], atol=1e-5)
    assert torch.allclose(head[draft_to_target_ids(d2t)], drafter.lm_head.weight, atol=1e-5)
    loaded, report = load_drafter(tmp_path / "out", smollm2_path)
    assert report.borrowed == ["embed_tokens.weight"] and loaded.config.draft_vocab_size == 49152
    assert torch.equal(loaded.embed_tokens.weight, embed)
