"""``slimspec generate --stream`` on a tiny target folder: the streamed text is the text ``--json``
reports for the same prompt, then one stats line; streaming more than one prompt is refused."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from slimspec_convert.checkpoint.save import save_drafter
from slimspec_convert.cli import app
from slimspec_convert.decoding.config import DraftConfig, GenerateConfig, SamplingConfig
from slimspec_convert.workflows.generate import generate_from_paths
from tests.helpers.eagle3_layouts import save_tiny_target
from tests.helpers.models import DATA, tiny_drafter, tiny_target, tiny_tokenizer


def test_generate_stream_prints_the_text_then_the_stats(tmp_path):
    target = tiny_target(seed=2)
    folder = save_tiny_target(target, tmp_path / "target")
    tiny_tokenizer().save_pretrained(folder)
    drafter = tiny_drafter(seed=1)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    save_drafter(drafter, tmp_path / "drafter")
    common = ["generate", "--target", str(folder), "--drafter", str(tmp_path / "drafter")]
    common += ["--prompt", "How many clips did Natalia sell?", "--max-new-tokens", "12", "--threads", "1"]
    runner = CliRunner()
    ref = runner.invoke(app, [*common, "--json"])
    assert ref.exit_code == 0, ref.output
    (want,) = json.loads(ref.stdout)
    streamed = runner.invoke(app, [*common, "--stream"])
    assert streamed.exit_code == 0, streamed.output
    text, stats, end = streamed.stdout.rsplit("\n", 2)
    assert text == want["text"] and len(text.split()) >= 5 and end == ""
    assert stats.startswith(
        f"{want['stats']['new_tokens']} new tokens, {want['stats']['cycles']} cycles, tau "
    )
    assert "(accepted drafts + 1 bonus per verification)" in stats
    bad = runner.invoke(app, [*common, "--stream", "--json"])
    assert bad.exit_code == 2 and "--stream and --json: choose one" in bad.output
    many = [*common[:5], "--prompts", str(DATA / "eval" / "mt_bench" / "question.jsonl"), "--stream"]
    bad = runner.invoke(app, many)
    assert bad.exit_code == 2 and "--stream prints one prompt's tokens" in bad.output
    # The pieces come one commit at a time, not as one block at the end.
    pieces: list[str] = []
    (res,) = generate_from_paths(
        folder,
        tmp_path / "drafter",
        "How many clips did Natalia sell?",
        None,
        GenerateConfig(),
        DraftConfig(),
        SamplingConfig(max_new_tokens=12),
        pieces.append,
    )
    assert "".join(pieces) == res.text == text and len(pieces) >= 3


def test_a_target_without_a_chat_template_gets_completion_prompts(tmp_path):
    """The tokenizer decides the mode (stderr names it); the prompt is encoded as raw text (this
    tokenizer adds no <s>): the first new token is the plain target's greedy token after those ids."""
    target = tiny_target(seed=2)
    folder = save_tiny_target(target, tmp_path / "target")
    tok = tiny_tokenizer()
    tok.chat_template = None
    tok.save_pretrained(folder)
    prompt = "How many clips did Natalia sell?"
    args = ["generate", "--target", str(folder), "--drafter", "none", "--prompt", prompt]
    args += ["--max-new-tokens", "4", "--threads", "1", "--json"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "prompts: completion, raw text after <bos> (the target's tokenizer has no chat" in res.stderr
    (got,) = json.loads(res.stdout)
    ids = tok(prompt)["input_ids"]
    assert tok.convert_tokens_to_ids("<|im_start|>") not in ids and len(ids) >= 6  # no template tokens
    with torch.no_grad():
        first = int(target(torch.tensor([ids])).logits[0, -1].argmax())
    assert got["output_ids"][0] == first
    forced = CliRunner().invoke(app, [*args, "--chat"])
    assert forced.exit_code == 2 and "--chat: the target's tokenizer has no chat template" in forced.output
