"""examples/last_step.py: a run's last saved step as a drafter folder, beside the kept checkpoint."""

import pytest
import torch

from slimspec_convert.checkpoint.load import load_drafter
from tests.helpers.scripts import load_script
from tests.unit.finetune.test_trainer import make_trainer

ls = load_script("examples/last_step.py")


def test_the_last_step_replaces_the_trainable_tensors_and_keeps_the_rest(tmp_path):
    run = tmp_path / "run"
    tr = make_trainer(run, steps=3, train="body")
    tr._save_best(tr.evaluate())  # the kept checkpoint: step 0
    for _ in range(2):
        tr.train_step()
    tr.save_checkpoint()
    trained = {n: p.detach().clone() for n, p in tr.drafter.named_parameters() if p.requires_grad}
    assert ls.last_step(run, tmp_path / "last", tr.target) == 2
    kept, _ = load_drafter(run, target=tr.target)
    last, _ = load_drafter(tmp_path / "last", target=tr.target)
    kept_p, last_p = dict(kept.named_parameters()), dict(last.named_parameters())
    assert trained and "lm_head.weight" in last_p and "lm_head.weight" not in trained  # frozen: kept
    for n, p in last_p.items():
        want = trained.get(n, kept_p[n])
        assert torch.equal(p.detach(), want.detach()), n
    assert any(not torch.equal(kept_p[n], trained[n]) for n in trained)  # guard: training moved them
    cfg = (tmp_path / "last" / "config.json").read_text()
    assert '"last_step": 2' in cfg
    with pytest.raises(FileExistsError):  # never replaced without --force
        ls.last_step(run, tmp_path / "last", tr.target)
    assert ls.last_step(run, tmp_path / "last", tr.target, force=True) == 2


def test_a_run_without_a_state_or_with_a_foreign_tensor_is_a_one_line_error(tmp_path, capsys):
    run = tmp_path / "run"
    tr = make_trainer(run, steps=1, train="body")
    tr._save_best(tr.evaluate())
    assert ls.main([str(run), str(tmp_path / "a")]) == 2
    assert "training_state.pt: not found" in capsys.readouterr().err
    tr.save_checkpoint()
    state = torch.load(run / ls.STATE, weights_only=True)
    state["trainable"]["midlayer.lora_A"] = torch.zeros(2)
    torch.save(state, run / ls.STATE)
    with pytest.raises(ValueError, match=r"'midlayer.lora_A' \(2,\) is not a parameter .* --train body"):
        ls.last_step(run, tmp_path / "b", tr.target)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
