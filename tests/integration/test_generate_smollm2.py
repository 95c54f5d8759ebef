"""Decoding with the real SmolLM2-135M-Instruct target: greedy speculative output equals plain decoding."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from slimspec_convert.decoding.config import DraftConfig, SamplingConfig
from slimspec_convert.decoding.generator import SpeculativeGenerator
from slimspec_convert.decoding.prompts import load_prompts
from tests.helpers.models import DATA, smollm2_drafter_config

MT_BENCH = DATA / "eval" / "mt_bench" / "question.jsonl"


# ---- integration: the real SmolLM2-135M-Instruct target ----------------------------------------
def smollm2_random_drafter(model):
    """A random drafter of SmolLM2's shape (d=576, 9/3 heads of 64, I=1536, V=49152), embedding
    borrowed from the target, no aux ids (so the upstream defaults apply, with a warning)."""
    from slimspec_convert.model.drafter import Eagle3Drafter

    torch.manual_seed(0)
    cfg = smollm2_drafter_config()
    drafter = Eagle3Drafter(cfg).eval()
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
    return drafter


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    from slimspec_convert.targets.load import load_target

    return load_target(smollm2_path, "float32")


@pytest.mark.integration
def test_smollm2_greedy_speculative_equals_plain_on_mt_bench(smollm2, caplog):
    model, tokenizer = smollm2
    questions = [t[0] for t in load_prompts(MT_BENCH)][:10]
    drafter = smollm2_random_drafter(model)
    draft = DraftConfig(method="tree", depth=3, top_k=3, total_tokens=8)
    with caplog.at_level(logging.WARNING, logger="slimspec_convert.targets.forward"):
        gen = SpeculativeGenerator(
            model, tokenizer, drafter, draft, SamplingConfig(max_new_tokens=24), batch_size=5
        )
    assert gen.aux_layers == (2, 15, 27) and "no aux layer ids" in caplog.text
    results = gen.generate(questions)
    for q, r in zip(questions, results, strict=True):
        ids, text = gen.encode(q)
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=2, pad_token_id=2
        )
        assert r.output_ids == out[0, len(ids) :].tolist(), q
        assert r.text == tokenizer.decode(r.output_ids, skip_special_tokens=True)
        assert r.stats.chat_template is not None and r.stats.chat_template.startswith("sha256:")


@pytest.mark.integration
def test_smollm2_demo_drafter_with_prompt_lookup_equals_plain(smollm2):
    """The committed drafter, chain-1 with 3 prompt-lookup tokens grafted (the main job's shape), in a
    batch of 2: greedy output equals transformers' greedy decoding, and lookup drafts were accepted."""
    from slimspec_convert.checkpoint.load import load_drafter
    from tests.helpers.models import REPO

    model, tokenizer = smollm2
    drafter, _ = load_drafter(REPO / "drafters" / "smollm2-135m-eagle3", target=model)
    prompts = [t[0] for t in load_prompts(REPO / "data" / "heldout" / "general24.jsonl")][:4]
    draft = DraftConfig(method="chain", depth=1, lookup=3)
    gen = SpeculativeGenerator(
        model, tokenizer, drafter.float().eval(), draft, SamplingConfig(max_new_tokens=64), batch_size=2
    )
    results = gen.generate(prompts)
    for p, r in zip(prompts, results, strict=True):
        ids, _ = gen.encode(p)
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=64, do_sample=False, eos_token_id=2, pad_token_id=2
        )
        assert r.output_ids == out[0, len(ids) :].tolist(), p
    assert sum(r.stats.lookup_tokens for r in results) >= 5
    assert max(max(r.stats.committed_per_cycle) for r in results) >= 3  # a lookup chain went deeper


@pytest.mark.integration
def test_smollm2_chat_rendering(smollm2):
    from slimspec_convert.decoding.prompts import render_chat

    _, tokenizer = smollm2
    default = render_chat(tokenizer, ["Hi"])
    assert default == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    two = render_chat(tokenizer, ["Hi", "More"], ["Hello!"], system_prompt="Be brief.")
    assert two == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nMore<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.integration
def test_cli_generate_json_drafter_equals_plain(smollm2, smollm2_path, tmp_path):
    from typer.testing import CliRunner

    from slimspec_convert.checkpoint.save import save_drafter
    from slimspec_convert.cli.app import app

    model, _ = smollm2
    save_drafter(smollm2_random_drafter(model), tmp_path / "drafter")
    common = ["generate", "--target", str(smollm2_path), "--prompts", str(MT_BENCH), "--limit", "2"]
    common += ["--max-new-tokens", "6", "--json", "--threads", "1"]
    runner = CliRunner()
    plain = runner.invoke(app, [*common, "--drafter", "none"])
    assert plain.exit_code == 0, plain.output
    spec = runner.invoke(
        app,
        [*common, "--drafter", str(tmp_path / "drafter"), "--draft", "chain", "--depth", "2"]
        + ["--lookup", "2"],
    )
    assert spec.exit_code == 0, spec.output
    a, b = json.loads(plain.stdout), json.loads(spec.stdout)
    assert [r["output_ids"] for r in a] == [r["output_ids"] for r in b]
    assert len(a) == 2 and a[0]["prompt"].startswith("Compose an engaging travel blog post")
    for r in b:
        assert set(r) >= {"prompt", "output_ids", "text", "stats"}
        assert set(r["stats"]) >= {
            "tau",
            "new_tokens",
            "cycles",
            "tokens_per_s",
            "wall_ms",
            "target_ms",
            "drafter_backbone_ms",
            "drafter_head_ms",
            "chat_template",
            "system_prompt",
        }
        assert r["stats"]["new_tokens"] == len(r["output_ids"]) <= 6
        assert r["stats"]["draft"]["lookup"] == 2
        assert r["stats"]["drafter_head_ms"] > 0
    # Two MT-Bench turns as one conversation, sampled (tree, top-p): turn 2 sees answer 1.
    conv = runner.invoke(
        app,
        [
            *common[:5],
            "--limit",
            "1",
            "--max-new-tokens",
            "5",
            "--json",
            "--threads",
            "1",
            "--all-turns",
            "--drafter",
            str(tmp_path / "drafter"),
            "--draft",
            "tree",  # sampled: a tree by hand (the default, auto, plans for greedy decoding)
            "--depth",
            "2",
            "--top-k",
            "2",
            "--total-tokens",
            "3",
            "--temperature",
            "0.7",
            "--top-p",
            "0.9",
            "--system-prompt",
            "Be brief.",
        ],
    )
    assert conv.exit_code == 0, conv.output
    t1, t2 = json.loads(conv.stdout)
    assert t2["prompt"] == "Rewrite your previous response. Start every sentence with the letter A."
    assert t1["text"] and t1["text"] in t2["prompt_text"] and t1["prompt"] in t2["prompt_text"]
    assert t2["prompt_text"].startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert t2["stats"]["system_prompt"] == "Be brief." and 1 <= t2["stats"]["new_tokens"] <= 5
    bad = runner.invoke(app, ["generate", "--target", str(smollm2_path), "--drafter", "none"])
    assert bad.exit_code == 2 and "exactly one of --prompt TEXT or --prompts" in bad.output
    bad = runner.invoke(app, [*common, "--drafter", str(tmp_path / "drafter"), "--rerank", "8"])
    assert bad.exit_code == 2 and "--rerank 8" in bad.output and "needs a low-rank lm_head" in bad.output
    bad = runner.invoke(app, [*common, "--drafter", "none", "--rerank", "8"])
    assert bad.exit_code == 2 and "--rerank needs a low-rank --drafter" in bad.output
