"""Per-batch decoding state and its cache-slot bookkeeping (left padding, holes, rollback, windows).

Rows share one target cache (and one drafter cache) of S slots. Each row has its own positions and
a validity mask over the slots (``valid``; None while every slot is real). After a round, row b
keeps ``n_b`` verified slots; the batch appends ``m = max_b n_b`` slots with row b's kept slots
right-aligned and ``m - n_b`` holes before them, which no query ever attends to.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import islice

import torch
from torch import Tensor

from slimspec_convert.decoding.results import StageTimes
from slimspec_convert.model.kv_cache import DraftKVCache
from slimspec_convert.targets.cache import keep_cache_slots, select_cache_rows


@dataclass(frozen=True)
class DecodeHooks:
    """Per-call options for callers that follow decoding token by token (transformers' ``generate``
    adapter, streaming). ``row`` below is the prompt's index in the call.

    Attributes:
        seeds: one sampling seed per prompt (None: ``SamplingConfig.seed`` for every prompt).
        on_commit: ``on_commit(row, tokens)`` with a row's newly committed tokens (after stop and
            budget truncation), in order, as soon as they are committed.
        stop_when: ``stop_when(row, output_ids)`` after each appended token (``output_ids`` is the
            row's live output list: read it, do not keep or change it); True ends the row after
            that token, as a stop token would (stop strings).
    """

    seeds: Sequence[int] | None = None
    on_commit: Callable[[int, list[int]], None] | None = None
    stop_when: Callable[[int, list[int]], bool] | None = None

    def window(self, lo: int, n: int) -> DecodeHooks:
        """The hooks of prompts ``lo .. lo+n-1`` decoded as one batch (its row b is prompt lo + b)."""
        on_commit, stop_when = self.on_commit, self.stop_when
        return DecodeHooks(
            seeds=None if self.seeds is None else list(self.seeds[lo : lo + n]),
            on_commit=None if on_commit is None else (lambda row, tokens: on_commit(lo + row, tokens)),
            stop_when=None if stop_when is None else (lambda row, out: stop_when(lo + row, out)),
        )


@dataclass
class DecodeState:
    """Mutable state of one batch (``rows`` index the batch's prompts; tensors cover active rows)."""

    rows: list[int]
    target_cache: object
    draft_cache: DraftKVCache | None
    valid: Tensor | None  # [B, S] bool, None = every slot real
    slot_pos: Tensor | None  # [B, S] int64 positions, kept only for windowed targets
    root_pos: Tensor  # [B] int64 position of the last committed token
    root_tok: Tensor  # [B] int64 last committed token
    h_last: Tensor | None  # [B, d] drafter output at the last real slot
    generators: list[torch.Generator]
    outputs: list[list[int]]
    committed: list[list[int]] = field(default_factory=list)
    finish_times: list[StageTimes | None] = field(default_factory=list)
    finish_wall: list[float] = field(default_factory=list)
    times: StageTimes = field(default_factory=StageTimes)
    t_start: float = 0.0
    hooks: DecodeHooks = field(default_factory=DecodeHooks)
    lookups: list | None = None  # per prompt, a decoding.lookup.NgramLookup (None: no prompt lookup)
    lookup_tokens: list[int] = field(default_factory=list)  # per prompt, accepted lookup-only drafts
    recent: list[dict[int, None]] | None = None  # per prompt, its distinct tokens, most recent last

    def remember(self, row: int, tokens: Sequence[int]) -> None:
        """Move ``tokens`` to the most recent end of prompt ``row``'s distinct tokens (if tracked)."""
        if self.recent is not None:
            seen = self.recent[row]
            for t in tokens:
                seen.pop(t, None)
                seen[t] = None

    def context_ids(self, limit: int, device) -> Tensor:
        """The active rows' most recent ``limit`` distinct tokens: [B, C] int64, a short row padded
        by repeating its last id (a rerank rescores a repeat to the same value)."""
        rows = [list(islice(reversed(self.recent[row]), limit))[::-1] for row in self.rows]  # O(limit)
        C = max(len(r) for r in rows)
        return torch.tensor([r + r[-1:] * (C - len(r)) for r in rows], dtype=torch.long, device=device)

    def commit(self, b: int, tokens: list[int], stop_ids, max_new_tokens: int, record: bool = True) -> bool:
        """Append active row b's tokens, cut after the first stop token (or ``hooks.stop_when``) and
        at max_new_tokens, then pass them to ``hooks.on_commit``.

        Returns:
            True when the row has finished.
        """
        row = self.rows[b]
        out = self.outputs[row]
        start, finished = len(out), False
        stop_when = self.hooks.stop_when
        for t in tokens[: max_new_tokens - start]:
            out.append(t)
            if t in stop_ids or (stop_when is not None and stop_when(row, out)):
                finished = True
                break
        self.remember(row, out[start:])
        finished = finished or len(out) >= max_new_tokens
        if record:
            self.committed[row].append(len(out) - start)
        if finished:
            self.finish_times[row] = self.times.copy()
            self.finish_wall[row] = (time.perf_counter() - self.t_start) * 1e3
        if self.hooks.on_commit is not None and len(out) > start:
            self.hooks.on_commit(row, out[start:])
        return finished

    def select(self, sel: Tensor) -> None:
        """Keep active rows ``sel`` ([B'] int64, in that order) in every per-row structure."""
        idx = sel.tolist()
        self.rows = [self.rows[i] for i in idx]
        self.generators = [self.generators[i] for i in idx]
        select_cache_rows(self.target_cache, sel)
        if self.draft_cache is not None:
            c = self.draft_cache
            c.keys = [x[sel] if x is not None else None for x in c.keys]
            c.values = [x[sel] if x is not None else None for x in c.values]
        for name in ("valid", "slot_pos", "root_pos", "root_tok", "h_last"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value[sel])
        if self.valid is not None and bool(self.valid.all()):
            self.valid = None


def pad_left(prompt_ids: Sequence[Sequence[int]], pad_id: int, device) -> tuple[Tensor, Tensor, list[int]]:
    """Left-pad prompts into a batch.

    Returns:
        (ids [B, P] int64, attention [B, P] int64 with 1 on real tokens, lengths).

    Raises:
        ValueError: an empty prompt.
    """
    lengths = [len(p) for p in prompt_ids]
    if min(lengths) == 0:
        raise ValueError("empty prompt: need at least one token")
    B, P = len(prompt_ids), max(lengths)
    ids = torch.full((B, P), pad_id, dtype=torch.long)
    attn = torch.zeros(B, P, dtype=torch.long)
    for b, p in enumerate(prompt_ids):
        ids[b, P - len(p) :] = torch.tensor(p, dtype=torch.long)
        attn[b, P - len(p) :] = 1
    return ids.to(device), attn.to(device), lengths


def verify_attention_mask(
    valid: Tensor,
    ancestors: Tensor | None,
    qpos: Tensor,
    slot_pos: Tensor | None,
    windows: dict[str, int | None],
    dtype: torch.dtype,
):
    """Additive 4-D attention mask for verifying T new tokens after S cached slots.

    transformers (5.x ``masking_utils._preprocess_mask_arguments``) passes a 4-D ``attention_mask``
    through unchanged; with explicit ``position_ids`` this gives tree attention. The mask is
    additive (0 = attend, dtype min = masked) so eager and SDPA attention both accept it; every
    query sees at least itself, so no row is fully masked.

    Args:
        valid: [B, S] bool, True for real cached slots (False for padding and holes).
        ancestors: [B, T, T] bool tree mask (query i may see new token j), None = causal chain.
        qpos: [B, T] int64 positions of the new tokens.
        slot_pos: [B, S] int64 positions of the cached slots (needed only with a window).
        windows: ``{layer_type: sliding window or None}`` (:func:`target.target_mask_windows`).
        dtype: the target's dtype.

    Returns:
        [B, 1, T, S + T] tensor, or ``{layer_type: tensor}`` when the target mixes layer types.
    """
    B, T = qpos.shape
    S = valid.shape[1]
    if ancestors is None:
        ancestors = torch.ones(T, T, dtype=torch.bool, device=qpos.device).tril().expand(B, T, T)
    allowed = torch.cat([valid[:, None, :].expand(B, T, S), ancestors], dim=-1)  # [B, T, S+T]
    masks = {}
    for layer_type, window in windows.items():
        m = allowed
        if window is not None:
            kpos = torch.cat([slot_pos, qpos], dim=1)  # [B, S+T]
            m = m & (kpos[:, None, :] > qpos[:, :, None] - window)  # HF sliding_window_overlay
        additive = torch.zeros(B, 1, T, S + T, dtype=dtype, device=qpos.device)
        masks[layer_type] = additive.masked_fill_(~m[:, None], torch.finfo(dtype).min)
    return next(iter(masks.values())) if len(masks) == 1 else masks


@dataclass
class KeptBlock:
    """The m slots a round appended (row b's n_b kept slots right-aligned).

    Attributes:
        index: [B, m] int64 verified-node index held by each new slot (0 in holes).
        src: [B, m] int64 position in the row's kept list (negative in holes).
        block_valid: [B, m] bool, or None when no row has holes.
        prefix_valid: [B, S] validity of the slots before the block (None = all real).
        positions: [B, m] int64 positions of the new slots (holes repeat the first).
        counts: [B] int64 n_b.
    """

    index: Tensor
    src: Tensor
    block_valid: Tensor | None
    prefix_valid: Tensor | None
    positions: Tensor
    counts: Tensor


def keep_accepted(st: DecodeState, path: Tensor, counts: list[int], S: int, copy_needed: bool) -> KeptBlock:
    """Roll the target cache back to the accepted paths and extend ``valid`` / ``slot_pos``.

    Args:
        st: batch state (its target cache holds S old slots plus the verified block).
        path: [B, D+1] accepted node indices (root first, -1 after).
        counts: n_b = accepted + 1 per row.
        S: slots before the verified block.
        copy_needed: False when node j already sits in slot j (chains), so a crop suffices.

    Returns:
        :class:`KeptBlock` describing the appended slots.
    """
    dev = path.device
    B, m = len(counts), max(counts)
    n = torch.tensor(counts, device=dev)
    col = torch.arange(m, device=dev)[None, :]
    src = col - (m - n)[:, None]  # [B, m]
    real = src >= 0
    index = torch.where(real, path.gather(1, src.clamp(min=0)), torch.zeros_like(src))
    uniform = min(counts) == m
    in_place = uniform and (not copy_needed or bool((index == col).all()))
    keep_cache_slots(st.target_cache, S, None if in_place else index, m)
    block_valid = None if uniform else real
    prefix_valid = st.valid
    if st.valid is not None or block_valid is not None:
        old = st.valid if st.valid is not None else torch.ones(B, S, dtype=torch.bool, device=dev)
        new = block_valid if block_valid is not None else torch.ones(B, m, dtype=torch.bool, device=dev)
        st.valid = torch.cat([old, new], dim=1)
    positions = st.root_pos[:, None] + src.clamp(min=0)  # [B, m]
    if st.slot_pos is not None:
        st.slot_pos = torch.cat([st.slot_pos, positions], dim=1)
    return KeptBlock(index, src, block_valid, prefix_valid, positions, n)
