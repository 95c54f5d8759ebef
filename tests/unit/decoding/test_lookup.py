"""Prompt lookup (decoding/lookup.py): the n-gram proposal, grafting it onto a draft tree, and
lossless decoding with it on tiny random targets (greedy equality with Hugging Face ``generate``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slimspec_convert.decoding.config import DraftConfig, SamplingConfig
from slimspec_convert.decoding.generator import SpeculativeGenerator
from slimspec_convert.decoding.lookup import NgramLookup, chain_tree, graft_sequences
from slimspec_convert.decoding.speculative import tree_from_parents, verify_tree_greedy
from tests.helpers.decoding import CHAIN, HEADS, TREE, hf_greedy
from tests.helpers.models import tiny_drafter


# ---- the proposal ----------------------------------------------------------------------------
def test_longest_suffix_first_then_most_recent_match():
    toks = [1, 2, 3, 9, 5, 2, 3, 7, 8, 1, 2, 3]
    # 3-gram (1, 2, 3) occurred once, ending at index 2: its continuation
    assert NgramLookup(toks, 2, 3).propose(3) == [9, 5, 2]
    # 2-gram (2, 3): the most recent earlier occurrence ends at index 6
    assert NgramLookup(toks, 2, 2).propose(3) == [7, 8, 1]
    assert NgramLookup(toks, 2, 2).propose(10) == [7, 8, 1, 2, 3]  # stops at the context's end
    assert NgramLookup([4, 5, 6, 7], 2, 3).propose(3) == []  # nothing recurs
    assert NgramLookup([4, 5, 6, 5], 1, 3).propose(2) == [6, 5]  # a 1-gram match
    assert NgramLookup([4, 4, 4], 2, 2).propose(3) == [4]  # overlapping occurrence


def test_sync_extends_the_index_as_a_fresh_one_would():
    prompt, output = [3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 9, 2, 6]
    lk = NgramLookup(prompt, 1, 3)
    for n in range(1, len(output) + 1):
        lk.sync(output[:n])
        assert lk.propose(4) == NgramLookup(prompt + output[:n], 1, 3).propose(4)
    assert lk.propose(4) == [5, 3, 5, 9]  # (9, 2, 6) recurs: the tokens after its first occurrence


def test_bad_ngram_sizes_are_refused():
    with pytest.raises(ValueError, match="1 <= min <= max"):
        NgramLookup([1], 3, 2)
    with pytest.raises(ValueError, match="DraftConfig.lookup=-1"):
        DraftConfig(lookup=-1)
    with pytest.raises(ValueError, match="lookup_min_ngram=0"):
        DraftConfig(lookup_min_ngram=0)


# ---- grafting ----------------------------------------------------------------------------------
def test_graft_shares_the_drafters_prefix_and_pads_short_rows():
    root = torch.tensor([10, 11])
    chain = chain_tree(root, torch.tensor([[4, 5], [6, 7]]), width=2)
    tree, grafted = graft_sequences(chain, [[4, 8, 9], []], width=2)
    # row 0: the lookup's 4 is the drafter's node 1; 8 and 9 are new, 8 a sibling of 5
    assert tree.tokens[0].tolist() == [10, 4, 5, 8, 9]
    assert tree.parents[0].tolist() == [-1, 0, 1, 1, 3]
    assert tree.depths[0].tolist() == [0, 1, 2, 2, 3]
    assert grafted[0].tolist() == [False, False, False, True, True]
    assert tree.children[0, 1].tolist() == [2, 3]
    # row 1 grafted nothing: two padding nodes, their own parents, no children, unreachable
    assert tree.parents[1].tolist() == [-1, 0, 1, 3, 4]
    assert grafted[1].tolist() == [False] * 5
    assert (tree.children[1, 3:] == -1).all()
    assert tree.ancestors[1, 3].tolist() == [False, False, False, True, False]
    # greedy verification follows the grafted path in row 0 and never enters row 1's padding
    want = {0: {0: 4, 1: 8, 3: 9, 4: 1}, 1: {0: 6, 1: 7, 2: 2, 3: 10, 4: 10}}
    logits = torch.full((2, 5, 12), -1.0)
    for b, nxt in want.items():
        for node, tok in nxt.items():
            logits[b, node, tok] = 1.0
    out = verify_tree_greedy(tree, logits)
    assert out.num_accepted.tolist() == [3, 2]
    assert out.path[0].tolist() == [0, 1, 3, 4]
    assert out.committed_tokens(tree.tokens).tolist() == [[4, 8, 9, 1], [6, 7, 2, -1]]


def test_tree_with_more_children_than_its_width_is_refused():
    tokens, parents = torch.tensor([[0, 1, 2, 3]]), torch.tensor([[-1, 0, 0, 0]])
    with pytest.raises(ValueError, match="3 children, more than width=2"):
        tree_from_parents(tokens, parents, torch.tensor([[0, 1, 1, 1]]), width=2)


# ---- decoding with it --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference40(target16, prompts16):
    torch.set_num_threads(1)
    return [hf_greedy(target16, p, 40) for p in prompts16]


def _run(model, drafter, prompts, draft, batch_size, **sampling):
    sampling = {"max_new_tokens": 40, **sampling}
    gen = SpeculativeGenerator(model, None, drafter, draft, SamplingConfig(**sampling), batch_size=batch_size)
    return gen.generate(prompts)


@pytest.mark.parametrize("draft", [CHAIN, TREE, None], ids=["chain", "tree", "lookup-alone"])
def test_greedy_with_lookup_equals_target_greedy(target16, prompts16, reference40, draft):
    drafter = None if draft is None else tiny_drafter(seed=0, **HEADS["dense"])
    cfg = dataclasses.replace(draft or DraftConfig(), lookup=4, lookup_min_ngram=1)
    for batch_size in (1, 3):
        res = _run(target16, drafter, prompts16, cfg, batch_size)
        assert [r.output_ids for r in res] == reference40
    # Guard: the random target's greedy text repeats, so lookup drafts were accepted, some deeper than 1
    assert sum(r.stats.lookup_tokens for r in res) >= 10
    assert max(max(r.stats.committed_per_cycle) for r in res) >= 3
    plain = _run(target16, drafter, prompts16, draft or DraftConfig(), 1) if draft else None
    if plain is not None:  # the same drafter without lookup commits fewer tokens per round
        assert sum(r.stats.cycles for r in res) < sum(r.stats.cycles for r in plain)
    if draft is None:
        assert res[0].stats.draft == {
            "method": "none",
            "lookup": 4,
            "lookup_min_ngram": 1,
            "lookup_max_ngram": 3,
        }


def test_sampling_with_lookup_rows_equal_their_batch1_output(target16, prompts16, reference40):
    drafter = tiny_drafter(seed=0, **HEADS["trimmed"])
    cfg = dataclasses.replace(TREE, lookup=3, lookup_min_ngram=1)
    kw = dict(temperature=0.9, top_p=0.95, seed=7)
    single = [_run(target16, drafter, [p], cfg, 1, **kw)[0].output_ids for p in prompts16]
    batched = [r.output_ids for r in _run(target16, drafter, prompts16, cfg, 3, **kw)]
    assert batched == single
    assert single != reference40  # guard: really sampled


def test_lookup_with_a_sampled_chain_is_refused(target16, tmp_path):
    cfg = dataclasses.replace(CHAIN, lookup=3)
    want = r"DraftConfig.lookup=3 with a chain and temperature 1.0: .* method='tree' \(--draft tree\)"
    with pytest.raises(ValueError, match=want):
        SpeculativeGenerator(
            target16, None, tiny_drafter(seed=0, **HEADS["dense"]), cfg, SamplingConfig(temperature=1.0)
        )
    # the CLI refuses it before loading any model (the paths do not exist)
    from typer.testing import CliRunner

    from slimspec_convert.cli.app import app

    args = ["generate", "--target", str(tmp_path / "no-target"), "--drafter", str(tmp_path / "no-drafter")]
    args += ["--prompt", "hi", "--draft", "chain", "--lookup", "3", "--temperature", "0.7"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "sampled chain drafts cannot share a tree" in res.output
