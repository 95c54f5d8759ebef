"""Issue 14: bad input never passes silently. Each hole is reproduced through the public CLI: exit code
2, one line ``error: ...`` naming the file and the field or tensor, nothing written, nothing lost.

The reference for "refused" in the safetensors cases is the safetensors library's own reader.
"""

from __future__ import annotations

import json
import shutil

import huggingface_hub
import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from finetune.config import FinetuneConfig
from finetune.run import finetune as run_finetune
from slimspec_convert.checkpoint.load import load_drafter
from slimspec_convert.checkpoint.save import save_drafter
from slimspec_convert.cli import app
from tests.helpers.eagle3_layouts import save_tiny_target, write_layout
from tests.helpers.models import DATA, tiny_drafter, tiny_target, tiny_tokenizer


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(model, folder with tokenizer) of the tiny 6-layer target (V=128, d=32)."""
    model = tiny_target()
    folder = save_tiny_target(model, tmp_path_factory.mktemp("target"))
    tiny_tokenizer().save_pretrained(folder)
    return model, folder


@pytest.fixture
def drafter_dir(target, tmp_path):
    """A SpecForge-layout drafter without aux layer ids (so K comes from the EAGLE-3 default, 3)."""
    drafter = tiny_drafter(aux_layer_ids=None)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target[0].get_input_embeddings().weight)
    return write_layout(drafter, "specforge", tmp_path / "drafter")


def commands(target_dir, drafter, out):
    """Every command that reads a drafter: inspect, convert, generate, finetune."""
    return [
        ["inspect", str(drafter)],
        ["convert", str(drafter), str(out), "--rank", "4"],
        ["generate", "--target", str(target_dir), "--drafter", str(drafter), "--prompt", "a b"],
        ["finetune", "--target", str(target_dir), "--drafter", str(drafter), "--data", "x.jsonl"]
        + ["--out", str(out)],
    ]


def refused(args, match: str) -> str:
    """Run the CLI; assert exit 2, no traceback and one ``error:`` line, the last, containing ``match``.

    Commands that load the target first may print transformers' weight-loading progress bar before it.
    """
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, (args, result.output)
    assert "Traceback" not in result.output, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("error: ") and result.output.count("error:") == 1, result.output
    assert match in line, line
    return line


def assert_nothing_written(tmp_path, name="out"):
    assert not (tmp_path / name).exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(f".{name}.")]


def _rewrite_header(path, edit):
    """Rewrite a safetensors file's JSON header with ``edit(header)``, keeping the data bytes."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n :])


# ---- 3: overlapping byte ranges -------------------------------------------------------------------
A, B = "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight"


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda h: h[B].update(data_offsets=h[A]["data_offsets"]), "overlapping"),
        (lambda h: h.pop(A), "of the data section but the tensors before it end at"),
    ],
    ids=["overlap", "gap"],
)
def test_safetensors_byte_ranges_must_tile_the_data(target, drafter_dir, tmp_path, edit, match):
    weights = drafter_dir / "model.safetensors"
    _rewrite_header(weights, edit)
    with pytest.raises(SafetensorError):  # the reference reader refuses the file too
        safe_open(str(weights), framework="pt")
    for args in commands(target[1], drafter_dir, tmp_path / "out"):
        line = refused(args, match)
        assert f"{weights}: tensor '" in line
    assert_nothing_written(tmp_path)


def test_safetensors_trailing_bytes_and_duplicate_keys(drafter_dir, tmp_path):
    weights = drafter_dir / "model.safetensors"
    clean = weights.read_bytes()
    weights.write_bytes(clean + b"\0" * 8)
    refused(["inspect", str(drafter_dir)], "data section holds")
    n = int.from_bytes(clean[:8], "little")
    header = clean[8 : 8 + n].decode().rstrip()
    dup = header[:-1] + f', "{A}": ' + json.dumps(json.loads(header)[A]) + "}"
    raw = dup.encode() + b" " * (-len(dup) % 8)
    weights.write_bytes(len(raw).to_bytes(8, "little") + raw + clean[8 + n :])
    refused(["inspect", str(drafter_dir)], f"{weights}: tensor '{A}' appears twice")


# ---- 4: NaN/inf outside the head -----------------------------------------------------------------
def test_nonfinite_tensor_outside_the_head_is_refused(target, drafter_dir, tmp_path):
    state = load_file(str(drafter_dir / "model.safetensors"))
    state["fc.weight"][3, 5] = float("nan")
    save_file(state, str(drafter_dir / "model.safetensors"))
    for args in commands(target[1], drafter_dir, tmp_path / "out"):
        refused(args, f"{drafter_dir / 'model.safetensors'}: 'fc.weight' has 1 NaN/inf entries")
    assert_nothing_written(tmp_path)


# ---- 5: a shape the config does not imply --------------------------------------------------------
def test_fc_of_two_aux_states_for_a_three_state_config(target, drafter_dir, tmp_path):
    state = load_file(str(drafter_dir / "model.safetensors"))
    state["fc.weight"] = state["fc.weight"][:, :64].contiguous()  # [d, 2d]: K read off fc would be 2
    save_file(state, str(drafter_dir / "model.safetensors"))
    for args in commands(target[1], drafter_dir, tmp_path / "out"):
        refused(
            args,
            f"{drafter_dir / 'model.safetensors'}: 'fc.weight' has shape [32, 64], expected [32, 96] "
            "from config.json",
        )
    assert_nothing_written(tmp_path)


# ---- 1: finetune keeps a drafter's own embedding -------------------------------------------------
@pytest.mark.parametrize("hidden_size", [32, 16], ids=["same-width", "narrower-than-target"])
def test_finetune_saves_the_drafters_own_embedding(target, tmp_path, hidden_size):
    drafter = tiny_drafter(seed=5, hidden_size=hidden_size, intermediate_size=48, target_hidden_size=32)
    own = drafter.embed_tokens.weight.detach().clone()  # random: differs from the target's table
    src = write_layout(drafter, "specforge", tmp_path / "src", with_embed=True)
    data = tmp_path / "data.jsonl"
    data.write_text("".join((DATA / "train" / "gsm8k" / "train.jsonl").read_text().splitlines(True)[:12]))
    cfg = FinetuneConfig(
        steps=1, ttt_steps=1, batch_size=2, max_length=32, eval_every=1, eval_batches=1, save_every=1,
        data_source="human",  # the files' answers: this test is about what the saved folder holds
    )  # fmt: skip
    run_finetune(target[1], src, [data], tmp_path / "out", cfg)
    loaded, report = load_drafter(tmp_path / "out", target[1])
    assert report.borrowed == [] and "embed_tokens.weight" in report.tensors
    assert torch.equal(loaded.embed_tokens.weight, own)  # frozen in training, so byte-identical
    assert loaded.config.own_embeddings


def test_a_table_that_cannot_be_borrowed_is_never_dropped(tmp_path):
    drafter = tiny_drafter(hidden_size=16, intermediate_size=48, target_hidden_size=32)
    with pytest.raises(
        ValueError, match=r"include_embeddings=False, but the drafter's 'embed_tokens.weight'"
    ):
        save_drafter(drafter, tmp_path / "out", include_embeddings=False)
    assert not (tmp_path / "out").exists()
    save_drafter(drafter.float(), tmp_path / "out")  # default: written, since d=16 != dt=32
    assert "embed_tokens.weight" in load_file(str(tmp_path / "out" / "model.safetensors"))
    state = load_file(str(tmp_path / "out" / "model.safetensors"))
    del state["embed_tokens.weight"]
    save_file(state, str(tmp_path / "out" / "model.safetensors"))
    refused(["inspect", str(tmp_path / "out")], "'slimspec.drafter_config.own_embeddings' is true but")


# ---- 6: a --target that is not a model -----------------------------------------------------------
def _not_a_model(kind, target_dir, tmp_path):
    """(the --target argument, what the error line must contain)."""
    bad = tmp_path / kind
    if kind == "hub-id-offline":
        return "no-such-org/no-such-model", "no-such-org/no-such-model: cannot load the target's tokenizer"
    shutil.copytree(target_dir, bad)
    if kind == "invalid-config":
        (bad / "config.json").write_text("{not json")
        return str(bad), f"{bad / 'config.json'}: invalid JSON"
    (bad / "model.safetensors").unlink()
    return str(bad), f"{bad}: no weight file (model.safetensors.index.json, model.safetensors"


@pytest.mark.parametrize("kind", ["invalid-config", "no-weights", "hub-id-offline"])
def test_target_that_is_not_a_model(target, drafter_dir, tmp_path, monkeypatch, kind):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    bad, match = _not_a_model(kind, target[1], tmp_path)
    out = tmp_path / "out"
    for args in commands(bad, drafter_dir, out)[2:]:  # generate, finetune
        refused(args, match)
    if kind != "hub-id-offline":  # convert reads a target folder's files itself
        refused(["convert", str(drafter_dir), str(out), "--rank", "4", "--target", bad], match)
    assert_nothing_written(tmp_path)


def test_target_with_truncated_weights(target, drafter_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(target[1], bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[:-100])
    for args in commands(bad, drafter_dir, tmp_path / "out")[2:]:  # read by transformers
        refused(args, f"{bad}: cannot load the target's weights (a local folder): Error while deserializing")
    convert = ["convert", str(drafter_dir), str(tmp_path / "out"), "--rank", "4", "--target", str(bad)]
    refused(convert, f"{bad / 'model.safetensors'}: tensor '")  # read by our header reader
    assert_nothing_written(tmp_path)


# ---- 7: a drafter where a target is expected -----------------------------------------------------
def test_drafter_folder_passed_as_target(target, tmp_path):
    src = write_layout(tiny_drafter(draft_vocab_size=64), "specforge", tmp_path / "src")
    as_target = write_layout(tiny_drafter(seed=1), "specforge", tmp_path / "other", with_embed=True)
    tiny_tokenizer().save_pretrained(as_target)  # as complete as a target folder looks
    out = tmp_path / "out"
    match = (
        f"{as_target}: --target is an EAGLE-3 drafter (config.json has ['draft_vocab_size', 'eagle_config'])"
        ", not a target model"
    )
    refused(["convert", str(src), str(out), "--rank", "4", "--full-vocab", "--target", str(as_target)], match)
    for args in commands(as_target, src, out)[2:]:
        refused(args, match)
    assert_nothing_written(tmp_path)
    config = json.loads((as_target / "config.json").read_text())  # SafeAILab EAGLE: a plain Llama config
    config.pop("draft_vocab_size"), config.pop("eagle_config")
    config["architectures"] = ["LlamaForCausalLM"]
    (as_target / "config.json").write_text(json.dumps(config))
    line = refused(
        ["convert", str(src), str(out), "--full-vocab", "--target", str(as_target)], "EAGLE-3 drafter"
    )
    assert "tensors ['" in line  # recognised by its fc / midlayer tensors
    refused(commands(as_target, src, out)[2], f"{as_target}: the weights lack ")
    assert_nothing_written(tmp_path)


# ---- 2: non-finite draft logits ------------------------------------------------------------------
@pytest.fixture(scope="module")
def loud_target(tmp_path_factory):
    """The tiny target with its embedding scaled by 1e4: aux states of norm ~2e3, as in real LLMs."""
    model = tiny_target()
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(1e4)
    folder = save_tiny_target(model, tmp_path_factory.mktemp("loud_target"))
    tiny_tokenizer().save_pretrained(folder)
    return model, folder


@pytest.mark.parametrize("draft", ["chain", "tree"])
def test_float16_drafter_whose_fc_overflows_stops_naming_stage_and_dtype(loud_target, tmp_path, draft):
    drafter = tiny_drafter(seed=2)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(loud_target[0].get_input_embeddings().weight)
        drafter.fc.weight.mul_(1e3)  # |w| <= ~100, fc outputs ~1e5: finite in float32, beyond float16's 65504
    src = write_layout(drafter, "specforge", tmp_path / "big_fc")
    args = ["generate", "--target", str(loud_target[1]), "--drafter", str(src), "--prompt", "a b c"]
    args += ["--draft", draft, "--depth", "3", "--top-k", "2", "--total-tokens", "4", "--max-new-tokens", "6"]
    refused(
        [*args, "--dtype", "float16"],
        "NaN/inf in the drafter fc output while decoding in float16: the values overflow float16; "
        "rerun with --dtype bfloat16 or float32",
    )
    ok = CliRunner().invoke(app, [*args, "--dtype", "float32", "--json"])
    assert ok.exit_code == 0, ok.output  # the same drafter is fine where it does not overflow


# ---- the same class of hole elsewhere ------------------------------------------------------------
def test_writers_refuse_nonfinite_tensors(target, tmp_path):
    src = write_layout(tiny_drafter(), "specforge", tmp_path / "src")
    state = load_file(str(src / "model.safetensors"))
    state["lm_head.weight"] *= 1e11  # finite in float32; its rank-4 factors overflow float16
    save_file(state, str(src / "model.safetensors"))
    line = refused(
        ["convert", str(src), str(tmp_path / "out"), "--rank", "4", "--dtype", "float16"],
        "/model.safetensors: 'lm_head.down.weight' has ",
    )
    assert line.startswith(f"error: {tmp_path / 'out' / 'model.safetensors'}: 'lm_head.down.weight' has ")
    assert line.endswith(
        "NaN/inf entries in float16 (the head's values overflow float16); nothing written: "
        "convert with --dtype bfloat16 or float32"
    ), line
    assert_nothing_written(tmp_path)
    drafter = tiny_drafter()
    with torch.no_grad():
        drafter.midlayer.mlp.up_proj.weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"'midlayer\.mlp\.up_proj\.weight' has 1 NaN/inf entries"):
        save_drafter(drafter, tmp_path / "out")
    assert_nothing_written(tmp_path)


def test_finetune_out_that_is_a_file_and_a_corrupt_resume_state(target, drafter_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join((DATA / "train" / "gsm8k" / "train.jsonl").read_text().splitlines(True)[:12]))
    args = ["finetune", "--target", str(target[1]), "--drafter", str(drafter_dir), "--data", str(data)]
    args += ["--data-source", "human"]
    (tmp_path / "file").write_text("keep me")
    refused([*args, "--out", str(tmp_path / "file")], f"{tmp_path / 'file'}: exists and is not a folder")
    assert (tmp_path / "file").read_text() == "keep me"
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "training_state.pt").write_bytes(b"not a torch file")
    refused(
        [*args, "--out", str(tmp_path / "out"), "--resume", "--steps", "1", "--max-length", "32"],
        f"{tmp_path / 'out' / 'training_state.pt'}: cannot be read to resume",
    )


def test_target_folder_passed_as_drafter(target, tmp_path):
    match = f"{target[1]}: a target model (architectures=['LlamaForCausalLM'], no 'fc.weight' and no drafter"
    for args in commands(target[1], target[1], tmp_path / "out"):
        refused(args, match)
    assert_nothing_written(tmp_path)
