"""finetune/train/init.py add_decoder_layer: a drafter grown by one decoder layer computes exactly
what it did before (every TTT step), saves and loads as a multi-layer EAGLE-3 drafter, and its new
layer trains."""

import torch
import torch.nn.functional as F

from finetune.train.init import add_decoder_layer
from slimspec_convert.checkpoint.load import load_drafter
from slimspec_convert.checkpoint.save import save_drafter
from slimspec_convert.model.ttt import ttt_unroll
from tests.helpers.models import tiny_drafter


def _batch(seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (2, 24), generator=gen)
    aux = torch.randn(2, 24, 96, generator=gen)
    return ids, aux, torch.ones_like(ids, dtype=torch.bool)


def _unrolled_logits(drafter, steps: int = 3) -> list[torch.Tensor]:
    ids, aux, mask = _batch()
    return [drafter.logits(s.hidden) for s in ttt_unroll(drafter, ids, aux, mask, steps)]


def test_grown_drafter_keeps_every_ttt_step():
    drafter = tiny_drafter()
    grown = add_decoder_layer(drafter, seed=1)
    assert grown.config.num_hidden_layers == 2 and len(grown.extra_layers) == 1
    with torch.no_grad():
        for a, b in zip(_unrolled_logits(grown), _unrolled_logits(drafter), strict=True):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    # twice: a third layer on top of the second, still the same function
    with torch.no_grad():
        again = add_decoder_layer(grown, seed=2)
        assert again.config.num_hidden_layers == 3
        torch.testing.assert_close(_unrolled_logits(again)[-1], _unrolled_logits(drafter)[-1], atol=0, rtol=0)


def test_grown_drafter_round_trips_and_its_new_layer_trains(tmp_path):
    grown = add_decoder_layer(tiny_drafter(), seed=1)
    save_drafter(grown, tmp_path / "d", include_embeddings=True)
    back, _ = load_drafter(tmp_path / "d")
    assert back.config.num_hidden_layers == 2
    for k, v in grown.state_dict().items():
        assert torch.equal(back.state_dict()[k].float(), v.float()), k
    layer = grown.extra_layers[0]
    grown.train()
    opt = torch.optim.SGD(grown.parameters(), lr=0.5)
    ids, aux, mask = _batch()
    losses = []
    for _ in range(2):
        opt.zero_grad()
        loss = sum(
            F.cross_entropy(grown.logits(s.hidden)[:, :-2].flatten(0, 1), ids[:, 2:].flatten())  # x_{t+2}
            for s in ttt_unroll(grown, ids, aux, mask, 1)
        )
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert layer.self_attn.o_proj.weight.abs().sum() > 0 and layer.mlp.down_proj.weight.abs().sum() > 0
    assert losses[1] < losses[0]
