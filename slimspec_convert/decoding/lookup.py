"""Prompt lookup drafts grafted onto the drafter's: copying from the context, losslessly.

A drafter of one decoder layer rarely copies: on the target's own answers the committed demo
drafter's first draft is right at 45% of the positions that continue an earlier bigram, and the
token after the most recent earlier match of the last 1-3 tokens is right where the drafter is
wrong at 23% of all positions (``examples/copy_diagnosis.py``). Prompt lookup (Saxena 2023, "Prompt
Lookup Decoding"; transformers' ``prompt_lookup_num_tokens``, vLLM's ``ngram`` speculator with
``prompt_lookup_min`` / ``prompt_lookup_max``) proposes exactly those tokens for free.

Here the lookup continuation is one more branch of the round's draft tree (a chain becomes a tree
with two branches from the root): it is inserted as a path from the root, sharing nodes where its
tokens equal the drafter's, so siblings stay distinct. The branch is a deterministic function of the
committed tokens, so every node remains a point-mass proposal and the tree verification of
``speculative.py`` stays lossless for greedy decoding and for sampling alike (its module docstring);
only a *sampled* chain cannot share a tree with it.

Unlike transformers (the earliest match), the most recent earlier match is used: in a chat answer
the nearest repetition is the likeliest to continue.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from slimspec_convert.decoding.speculative import DraftTree, tree_from_parents


class NgramLookup:
    """Incremental n-gram index over one row's tokens (prompt, then committed output).

    Args:
        tokens: the prompt's token ids.
        min_ngram, max_ngram: suffix lengths tried, longest first (vLLM's ``prompt_lookup_min`` /
            ``prompt_lookup_max``).

    Raises:
        ValueError: ``1 <= min_ngram <= max_ngram`` does not hold.
    """

    def __init__(self, tokens: Sequence[int], min_ngram: int, max_ngram: int) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"lookup n-gram sizes {min_ngram}..{max_ngram}: expected 1 <= min <= max")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.tokens: list[int] = list(tokens)
        self.prompt_len = len(self.tokens)
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> end index of its latest indexed occurrence
        self._indexed = 0  # n-grams ending before this index are in ``_last``

    def sync(self, output: Sequence[int]) -> None:
        """Append the row's output tokens not seen yet (``output`` = all its committed new tokens)."""
        self.tokens.extend(output[len(self.tokens) - self.prompt_len :])

    def propose(self, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` tokens that followed the most recent earlier occurrence of the longest
        suffix (``max_ngram`` down to ``min_ngram`` tokens) of the row's tokens; [] when none recurs."""
        toks = self.tokens
        end = len(toks) - 1  # the suffix ends here; earlier matches end at most at end - 1
        for e in range(self._indexed, end):  # index the n-grams ending before the suffix
            for n in range(self.min_ngram, self.max_ngram + 1):
                if e + 1 >= n:
                    self._last[tuple(toks[e + 1 - n : e + 1])] = e
        self._indexed = max(self._indexed, end)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if end + 1 < n:
                continue
            e = self._last.get(tuple(toks[end + 1 - n :]))
            if e is not None:
                return toks[e + 1 : e + 1 + max_tokens]
        return []


def lookup_matches(
    tokens: Sequence[int], roots: Sequence[int], end: int, max_tokens: int, min_ngram: int, max_ngram: int
) -> list[tuple[int, int]]:
    """What prompt lookup would propose at given round starts of a known text (for planning).

    Args:
        tokens: the whole text (prompt, then the target's answer).
        roots: ascending indices of the root (last committed token) of each round start.
        end: tokens at or after this index are not part of the text (padding).
        max_tokens, min_ngram, max_ngram: as ``DraftConfig.lookup`` and its n-gram sizes.

    Returns:
        Per root, (tokens proposed, how many of them lead the text's own continuation).
    """
    out = []
    lk: NgramLookup | None = None
    for r in roots:
        if lk is None:
            lk = NgramLookup(tokens[: r + 1], min_ngram, max_ngram)
        else:
            lk.sync(tokens[lk.prompt_len : r + 1])
        prop = lk.propose(max_tokens)
        match = 0
        for x, y in zip(prop, tokens[r + 1 : end], strict=False):
            if x != y:
                break
            match += 1
        out.append((len(prop), match))
    return out


def chain_tree(root_tokens: torch.Tensor, draft_ids: torch.Tensor, width: int) -> DraftTree:
    """A chain of drafts as a :class:`DraftTree` (node i's parent is node i - 1).

    Args:
        root_tokens: [B] int64.
        draft_ids: [B, k] int64 target ids (k >= 0).
        width: children slots per node (room for the grafted branch).
    """
    B, k = draft_ids.shape
    dev = draft_ids.device
    tokens = torch.cat([root_tokens[:, None], draft_ids], dim=1)
    parents = (torch.arange(k + 1, device=dev) - 1).expand(B, k + 1)
    depths = torch.arange(k + 1, device=dev).expand(B, k + 1)
    return tree_from_parents(tokens, parents, depths, width)


def graft_sequences(
    tree: DraftTree, seqs: Sequence[Sequence[int]], width: int
) -> tuple[DraftTree, torch.Tensor]:
    """Insert one token sequence per row as a path from the root, sharing existing nodes.

    Args:
        tree: [B, T] draft tree (siblings distinct).
        seqs: per row, target ids to follow from the root (may be empty).
        width: children slots per node of the result (the tree's own plus one).

    Returns:
        (tree with T' >= T nodes, rows padded as :func:`tree_from_parents` describes;
        [B, T'] bool, True on the nodes only the grafted sequence proposed).
    """
    B, T = tree.tokens.shape
    dev = tree.tokens.device
    toks, pars, deps = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
    grafted: list[set[int]] = []
    for b in range(B):
        child = {(p, t): i for i, (p, t) in enumerate(zip(pars[b], toks[b], strict=True)) if 0 <= p != i}
        cur, new = 0, set()
        for t in seqs[b]:
            nxt = child.get((cur, int(t)))
            if nxt is None:
                nxt = len(toks[b])
                toks[b].append(int(t))
                pars[b].append(cur)
                deps[b].append(deps[b][cur] + 1)
                child[(cur, int(t))] = nxt
                new.add(nxt)
            cur = nxt
        grafted.append(new)
    T2 = max(len(t) for t in toks)
    for b in range(B):
        while len(toks[b]) < T2:  # padding: its own parent, unreachable
            pars[b].append(len(toks[b]))
            toks[b].append(toks[b][0])
            deps[b].append(1)
    out = tree_from_parents(
        torch.tensor(toks, device=dev), torch.tensor(pars, device=dev), torch.tensor(deps, device=dev), width
    )
    mask = torch.tensor([[i in grafted[b] for i in range(T2)] for b in range(B)], device=dev)
    return out, mask
