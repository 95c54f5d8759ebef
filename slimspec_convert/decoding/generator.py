"""The decoding loop: plain target decoding, or EAGLE-3 speculative decoding with a chain or a
dynamic tree, batched with left padding, exact KV rollback and per-prompt statistics.

One round (per batch of active rows): draft from ``h_last`` (drafting.py), verify the root plus
the drafts in one target forward (tree attention as a custom 4-D mask with explicit position ids),
accept (speculative.py), commit with stop-token / budget truncation, keep the accepted slots of the
target cache, then run the drafter on the committed tokens with the target's features (its draft
slots were already cropped), which also gives the next round's ``h_last``.

Batching: rows share one cache tensor; each row keeps its own positions (``root_pos``) and a
validity mask over cache slots (``valid``, None while every slot is real). A round appends
``m = max_b n_b`` slots; row b's ``n_b`` kept slots are right-aligned and the rest are holes that no
query attends to, so a row computes exactly what it would alone (up to float summation order).
Finished rows leave the batch. Sampling draws per-row uniforms from a per-row generator seeded with
``SamplingConfig.seed`` (or the prompt's own seed in ``DecodeHooks.seeds``), so a prompt's output does
not depend on its batch. ``DecodeHooks`` also carries a per-commit callback (streaming) and a stop
predicate checked after every token (stop strings).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import asdict

import torch
from torch import Tensor

from slimspec_convert.decoding.batch import (
    DecodeHooks,
    DecodeState,
    keep_accepted,
    pad_left,
    verify_attention_mask,
)
from slimspec_convert.decoding.config import DraftConfig, SamplingConfig, check_lookup_sampling
from slimspec_convert.decoding.drafting import DrafterRunner, block_mask, check_finite_logits
from slimspec_convert.decoding.lookup import NgramLookup, chain_tree, graft_sequences
from slimspec_convert.decoding.prompts import chat_template_id, render_chat
from slimspec_convert.decoding.results import GenerationResult, GenerationStats, StageTimes
from slimspec_convert.decoding.speculative import (
    RoundOutcome,
    draw_uniforms,
    process_logits,
    sample_from_probs,
    tau_from_committed,
    tree_uniforms_needed,
    verify_chain_greedy,
    verify_chain_sampling,
    verify_tree_greedy,
    verify_tree_sampling,
)
from slimspec_convert.devices import clock_ms, module_device
from slimspec_convert.model.drafter import Eagle3Drafter
from slimspec_convert.model.kv_cache import DraftKVCache
from slimspec_convert.targets.cache import cache_length, new_target_cache, target_mask_windows
from slimspec_convert.targets.forward import resolve_aux_layers, target_forward
from slimspec_convert.targets.load import resolve_chat

logger = logging.getLogger(__name__)


class SpeculativeGenerator:
    """Generate with a target alone or with an EAGLE-3 drafter; greedy output equals the target's.

    Args:
        target_model: HF causal LM (eval mode).
        tokenizer: its tokenizer (None when prompts are token ids).
        drafter: EAGLE-3 drafter, or None for plain target decoding.
        draft: chain (k = depth) or tree drafting shape.
        sampling: temperature 0 = greedy, else lossless speculative sampling.
        chat: apply the tokenizer's chat template to string prompts (True), encode them as raw text
            after ``<bos>`` (False: completion prompts), or None: chat when the tokenizer has a chat
            template (:func:`~slimspec_convert.targets.load.resolve_chat`).
        system_prompt: system message for the chat template (None = template default).
        batch_size: prompts decoded together (left-padded).
        stop_ids: exactly these stop token ids (None: ``sampling.stop_token_ids`` plus the eos ids of
            the model's generation config, its config and the tokenizer).

    Raises:
        ValueError: drafter and target disagree (vocabulary, hidden width, aux layers), the
            draft shape does not fit the drafter, or prompt lookup with a sampled chain
            (:func:`~slimspec_convert.decoding.config.check_lookup_sampling`).
    """

    def __init__(
        self,
        target_model,
        tokenizer,
        drafter: Eagle3Drafter | None,
        draft: DraftConfig | None = None,
        sampling: SamplingConfig | None = None,
        *,
        chat: bool | None = None,
        system_prompt: str | None = None,
        batch_size: int = 1,
        stop_ids: Sequence[int] | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: expected >= 1")
        self.model = target_model
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.draft = draft or DraftConfig()
        self.sampling = sampling or SamplingConfig()
        self.chat = resolve_chat(tokenizer, chat).chat if tokenizer is not None else bool(chat)
        self.system_prompt = system_prompt
        self.batch_size = batch_size
        self.greedy = self.sampling.temperature == 0
        self.device = next(target_model.parameters()).device
        self.dtype = next(target_model.parameters()).dtype
        self.windows = target_mask_windows(target_model)
        self.stop_ids = self._stop_ids() if stop_ids is None else frozenset(int(t) for t in stop_ids)
        self.pad_id = self._pad_id()
        self.aux_layers: tuple[int, ...] = ()
        if drafter is not None:
            self.aux_layers = self._check_drafter(drafter)
            check_lookup_sampling(self.draft, self.sampling)

    # ---- setup -------------------------------------------------------------------------------
    def _check_drafter(self, drafter: Eagle3Drafter) -> tuple[int, ...]:
        cfg, tcfg = drafter.config, self.model.config
        if cfg.vocab_size != tcfg.vocab_size:
            raise ValueError(
                f"drafter vocab_size={cfg.vocab_size} != target vocab_size={tcfg.vocab_size}; wrong target?"
            )
        if cfg.resolved_target_hidden_size != tcfg.hidden_size:
            raise ValueError(
                f"drafter target_hidden_size={cfg.resolved_target_hidden_size} != target hidden_size="
                f"{tcfg.hidden_size}; wrong target?"
            )
        if module_device(drafter) != self.device:
            raise ValueError(
                f"the drafter is on {module_device(drafter)} but the target on {self.device}; "
                "move both to one device (drafter.to(device))"
            )
        aux = resolve_aux_layers(cfg, self.model)
        self.runner = DrafterRunner(drafter, self.draft, self.sampling, StageTimes())
        return aux

    def _stop_ids(self) -> frozenset[int]:
        ids = set(self.sampling.stop_token_ids)
        for found in eos_sources(self.model, self.tokenizer).values():
            ids.update(found)
        return frozenset(ids)

    def _pad_id(self) -> int:
        for src in (self.tokenizer, getattr(self.model, "generation_config", None), self.model.config):
            pad = getattr(src, "pad_token_id", None) if src is not None else None
            if isinstance(pad, int):
                return pad
        return 0

    # ---- prompts ---------------------------------------------------------------------------
    def encode(
        self, prompt: str | Sequence[int], history: Sequence[tuple[str, str]] = ()
    ) -> tuple[list[int], str | None]:
        """Token ids (and rendered text) of a prompt; ``history`` = earlier (user, answer) turns.

        Raises:
            ValueError: a string prompt without a tokenizer, or chat without a template.
        """
        if not isinstance(prompt, str):
            return [int(t) for t in prompt], None
        if self.tokenizer is None:
            raise ValueError("string prompts need a tokenizer; pass token ids instead")
        if self.chat:
            users = [u for u, _ in history] + [prompt]
            text = render_chat(self.tokenizer, users, [a for _, a in history], self.system_prompt)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"], text
        if history:
            raise ValueError("multi-turn prompts need the chat template (chat=True)")
        return self.tokenizer(prompt)["input_ids"], prompt

    # ---- public API --------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(
        self, prompts: Sequence[str | Sequence[int]], hooks: DecodeHooks | None = None
    ) -> list[GenerationResult]:
        """Generate for each prompt (strings or token-id lists), ``batch_size`` at a time.

        Args:
            prompts: strings (encoded, with the chat template when ``chat``) or token-id lists.
            hooks: per-prompt seeds, a per-commit callback and a stop predicate (rows = prompt index).

        Returns:
            One :class:`GenerationResult` per prompt, in order.

        Raises:
            ValueError: ``hooks.seeds`` does not hold one seed per prompt.
        """
        hooks = hooks or DecodeHooks()
        if hooks.seeds is not None and len(hooks.seeds) != len(prompts):
            raise ValueError(f"hooks.seeds has {len(hooks.seeds)} seeds for {len(prompts)} prompts")
        return self._generate([(p, ()) for p in prompts], hooks)

    @torch.inference_mode()
    def generate_conversations(self, conversations: Sequence[Sequence[str]]) -> list[list[GenerationResult]]:
        """Multi-turn chat (MT-Bench ``turns``): turn t sees the model's own answers to turns < t.

        Returns:
            Per conversation, one result per turn.
        """
        results: list[list[GenerationResult]] = [[] for _ in conversations]
        for t in range(max(len(c) for c in conversations)):
            todo = [i for i, c in enumerate(conversations) if len(c) > t]
            items = []
            for i in todo:
                history = tuple((conversations[i][j], results[i][j].text or "") for j in range(t))
                items.append((conversations[i][t], history))
            for i, res in zip(todo, self._generate(items, DecodeHooks()), strict=True):
                results[i].append(res)
        return results

    def _generate(self, items, hooks: DecodeHooks) -> list[GenerationResult]:
        encoded = [self.encode(p, h) for p, h in items]
        out: list[GenerationResult] = []
        for lo in range(0, len(items), self.batch_size):
            batch = encoded[lo : lo + self.batch_size]
            state = self.start([ids for ids, _ in batch], hooks.window(lo, len(batch)))
            while state.rows:
                self.step(state)
            for j, (ids, text) in enumerate(batch):
                prompt = items[lo + j][0]
                out.append(self._result(state, j, prompt if isinstance(prompt, str) else None, ids, text))
        return out

    # ---- prefill -----------------------------------------------------------------------------
    def start(self, prompt_ids: Sequence[Sequence[int]], hooks: DecodeHooks | None = None) -> DecodeState:
        """Prefill a batch: target forward over the prompts, first token, drafter prefill.

        Args:
            prompt_ids: token ids per row (non-empty).
            hooks: this batch's seeds and callbacks (row b = ``prompt_ids[b]``); None = none.

        Returns:
            The batch's :class:`DecodeState` (rows that already finished have left it).

        Raises:
            ValueError: an empty prompt.
        """
        ids, attn, lengths = pad_left(prompt_ids, self.pad_id, self.device)
        B, P = ids.shape
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        padded = min(lengths) != P
        st = self._new_state(lengths, attn.bool() if padded else None, pos, hooks or DecodeHooks())
        if self.draft.lookup:
            d = self.draft
            st.lookups = [NgramLookup(p, d.lookup_min_ngram, d.lookup_max_ngram) for p in prompt_ids]
        if self.drafter is not None:
            self.runner.times = st.times
            self.runner.set_context(None)  # a pool is this batch's own, set each round
            if self.runner.context_size:
                st.recent = [{} for _ in prompt_ids]
                for b, p in enumerate(prompt_ids):
                    st.remember(b, p)
        out = self._target(
            st, ids, attention_mask=attn if padded else None, position_ids=pos, logits_to_keep=1
        )
        last = out.logits[:, -1]  # [B, V]
        check_finite_logits(last)
        if self.greedy:
            first = last.argmax(-1)
        else:
            probs = process_logits(last, self.sampling.temperature, self.sampling.top_p, self.sampling.top_k)
            first = sample_from_probs(probs, draw_uniforms(st.generators, 1).to(self.device)[:, 0])
        st.root_tok = first
        max_new = self.sampling.max_new_tokens
        finished = [
            st.commit(b, [t], self.stop_ids, max_new, record=False) for b, t in enumerate(first.tolist())
        ]
        keep = [b for b in range(B) if not finished[b]]
        aux, tokens = out.aux_hidden, torch.cat([ids[:, 1:], first[:, None]], dim=1)
        if len(keep) < B:
            sel = torch.tensor(keep, dtype=torch.long, device=self.device)
            st.select(sel)
            aux, tokens, pos, attn = aux[sel], tokens[sel], pos[sel], attn[sel]
        if self.drafter is not None and st.rows:
            st.draft_cache = DraftKVCache()
            mask = block_mask(None, attn.bool() if padded else None, len(st.rows), P, 0, self.device)
            st.h_last = self.runner.real_forward(st.draft_cache, aux, tokens, pos, mask)
        return st

    def _new_state(
        self, lengths: list[int], valid: Tensor | None, pos: Tensor, hooks: DecodeHooks
    ) -> DecodeState:
        B = len(lengths)
        seeds = hooks.seeds if hooks.seeds is not None else [self.sampling.seed] * B
        return DecodeState(
            rows=list(range(B)),
            target_cache=new_target_cache(),
            draft_cache=None,
            valid=valid,
            slot_pos=pos if self._windowed() else None,
            root_pos=torch.tensor(lengths, device=self.device),
            root_tok=torch.zeros(B, dtype=torch.long, device=self.device),
            h_last=None,
            generators=[torch.Generator().manual_seed(int(seed)) for seed in seeds],
            outputs=[[] for _ in range(B)],
            committed=[[] for _ in range(B)],
            finish_times=[None] * B,
            finish_wall=[0.0] * B,
            lookup_tokens=[0] * B,
            t_start=time.perf_counter(),
            hooks=hooks,
        )

    def _windowed(self) -> bool:
        return any(w is not None for w in self.windows.values())

    def _target(self, st: DecodeState, ids: Tensor, **kwargs):
        t0 = clock_ms(self.device)
        out = target_forward(
            self.model,
            ids,
            self.aux_layers or (0,),
            past_key_values=st.target_cache,
            use_cache=True,
            **kwargs,
        )
        st.times.target_ms += clock_ms(self.device) - t0
        return out

    # ---- one round ---------------------------------------------------------------------------
    def step(self, st: DecodeState) -> RoundOutcome:
        """One draft-verify-commit round for every active row.

        Returns:
            The round's :class:`RoundOutcome` for the rows active at its start (for tests).
        """
        B, S = len(st.rows), cache_length(st.target_cache)
        k, K, D = self.draft.depth, self.draft.top_k, self.draft.depth
        method = "plain" if self.drafter is None else self.draft.method
        L = self.draft.lookup
        width = {"plain": 0, "chain": 1, "tree": K}[method] + 1  # children slots with a lookup branch
        uniforms = None
        if not self.greedy:
            if L:
                n = tree_uniforms_needed(max(L, 0 if method == "plain" else D), width)
            else:
                n = {"plain": 1, "chain": 2 * k + 1, "tree": tree_uniforms_needed(D, K)}[method]
            uniforms = draw_uniforms(st.generators, n).to(self.device)
        tree = draft_ids = q = anc = lookup_nodes = None
        if st.recent is not None:
            self.runner.set_context(st.context_ids(self.runner.context_size, self.device))
        if method == "plain":
            draft_ids = st.root_tok.new_zeros(B, 0)
        elif method == "chain":
            draft_ids, q = self.runner.draft_chain(
                st.draft_cache,
                st.h_last,
                st.root_pos,
                st.valid,
                None if uniforms is None else uniforms[:, :k],
            )
        else:
            tree = self.runner.draft_tree(st.draft_cache, st.h_last, st.root_tok, st.root_pos, st.valid)
        if L:
            if tree is None:
                tree = chain_tree(st.root_tok, draft_ids, width)
            seqs = []
            for row in st.rows:
                st.lookups[row].sync(st.outputs[row])
                seqs.append(st.lookups[row].propose(L))
            tree, lookup_nodes = graft_sequences(tree, seqs, width)
            method = "tree"
        if tree is not None:
            nodes, depths, anc = tree.tokens, tree.depths, tree.ancestors
        else:
            k_ = draft_ids.shape[1]
            nodes = torch.cat([st.root_tok[:, None], draft_ids], dim=1)
            depths = torch.arange(k_ + 1, device=self.device).expand(B, k_ + 1)
        qpos = st.root_pos[:, None] + depths  # [B, T]
        out = self._target(st, nodes, attention_mask=self._target_mask(st, anc, qpos, S), position_ids=qpos)
        check_finite_logits(out.logits)
        outcome = self._verify(method, out.logits, draft_ids, q, tree, uniforms)
        committed = outcome.committed_tokens(nodes)
        counts = (outcome.num_accepted + 1).tolist()
        rows = committed.tolist()
        max_new = self.sampling.max_new_tokens
        finished = [st.commit(b, rows[b][: counts[b]], self.stop_ids, max_new) for b in range(B)]
        if lookup_nodes is not None:
            self._count_lookup(st, outcome, lookup_nodes)
        self._advance(st, outcome, out.aux_hidden, committed, counts, finished, S, method)
        return outcome

    @staticmethod
    def _count_lookup(st: DecodeState, outcome: RoundOutcome, lookup_nodes: Tensor) -> None:
        """Add each row's committed drafts that only the prompt lookup proposed."""
        path = outcome.path[:, 1:]
        hit = lookup_nodes.gather(1, path.clamp(min=0)) & (path >= 0)  # [B, D]
        accepted = outcome.num_accepted.tolist()
        for b, row in enumerate(st.rows):
            drafts = min(accepted[b], st.committed[row][-1])  # a stop token may cut the drafts short
            st.lookup_tokens[row] += int(hit[b, :drafts].sum())

    def _verify(self, method, logits, draft_ids, q, tree, uniforms) -> RoundOutcome:
        if method == "tree":
            if self.greedy:
                return verify_tree_greedy(tree, logits)
            probs = process_logits(
                logits, self.sampling.temperature, self.sampling.top_p, self.sampling.top_k
            )
            return verify_tree_sampling(tree, probs, uniforms)
        if draft_ids is None:  # plain decoding: a chain of zero drafts
            draft_ids = logits.new_zeros(logits.shape[0], 0, dtype=torch.long)
        if self.greedy:
            return verify_chain_greedy(draft_ids, logits)
        probs = process_logits(logits, self.sampling.temperature, self.sampling.top_p, self.sampling.top_k)
        k = draft_ids.shape[1]
        if q is None:
            q = probs.new_zeros(probs.shape[0], 0, probs.shape[-1])
        return verify_chain_sampling(draft_ids, q, probs, uniforms[:, -(k + 1) :])

    def _target_mask(self, st: DecodeState, anc: Tensor | None, qpos: Tensor, S: int):
        """The verify pass's mask, or None when plain causal attention over the cache is exact."""
        if anc is None and st.valid is None and not self._windowed():
            return None
        B = qpos.shape[0]
        valid = st.valid if st.valid is not None else torch.ones(B, S, dtype=torch.bool, device=self.device)
        return verify_attention_mask(valid, anc, qpos, st.slot_pos, self.windows, self.dtype)

    def _advance(self, st, outcome, aux, committed, counts, finished, S, method) -> None:
        """Drop finished rows, keep accepted target slots, run the drafter on the committed tokens."""
        keep = [b for b in range(len(finished)) if not finished[b]]
        if not keep:
            st.rows = []
            return
        if len(keep) < len(finished):
            sel = torch.tensor(keep, dtype=torch.long, device=self.device)
            st.select(sel)
            outcome = RoundOutcome(outcome.num_accepted[sel], outcome.path[sel], outcome.bonus[sel])
            aux, committed, counts = aux[sel], committed[sel], [counts[b] for b in keep]
        kept = keep_accepted(st, outcome.path, counts, S, copy_needed=method == "tree")
        if self.drafter is not None:
            B, m = kept.index.shape
            tokens = committed.gather(1, kept.src.clamp(min=0))  # [B, m]: drafts then bonus
            feats = aux.gather(1, kept.index[:, :, None].expand(B, m, aux.shape[-1]))  # [B, m, K*dt]
            mask = block_mask(kept.prefix_valid, kept.block_valid, B, m, S, self.device)
            st.h_last = self.runner.real_forward(st.draft_cache, feats, tokens, kept.positions, mask)
        st.root_pos = st.root_pos + kept.counts
        st.root_tok = outcome.bonus

    # ---- results -----------------------------------------------------------------------------
    def _draft_dict(self) -> dict:
        d = asdict(self.draft)
        if self.drafter is None:  # plain decoding, or prompt lookup alone
            keep = ("lookup", "lookup_min_ngram", "lookup_max_ngram") if self.draft.lookup else ()
            return {"method": "none", **{key: d[key] for key in keep}}
        return d

    def _result(self, st: DecodeState, row: int, prompt: str | None, ids: list[int], text: str | None):
        times = st.finish_times[row] or st.times
        wall = st.finish_wall[row]
        out = st.outputs[row]
        busy = times.target_ms + times.drafter_backbone_ms + times.drafter_head_ms
        stats = GenerationStats(
            tau=tau_from_committed(st.committed[row]),
            new_tokens=len(out),
            cycles=len(st.committed[row]),
            tokens_per_s=len(out) / (wall / 1e3) if wall > 0 else 0.0,
            wall_ms=wall,
            target_ms=times.target_ms,
            drafter_backbone_ms=times.drafter_backbone_ms,
            drafter_head_ms=times.drafter_head_ms,
            overhead_ms=max(wall - busy, 0.0),
            committed_per_cycle=list(st.committed[row]),
            draft=self._draft_dict(),
            sampling={
                "temperature": self.sampling.temperature,
                "top_p": self.sampling.top_p,
                "top_k": self.sampling.top_k,
                "max_new_tokens": self.sampling.max_new_tokens,
                "seed": self.sampling.seed,
            },
            batch_size=self.batch_size,
            chat_template=chat_template_id(self.tokenizer) if self.chat and text is not None else None,
            system_prompt=self.system_prompt if self.chat and text is not None else None,
            lookup_tokens=st.lookup_tokens[row],
        )
        decoded = self.tokenizer.decode(out, skip_special_tokens=True) if self.tokenizer is not None else None
        return GenerationResult(prompt, text, list(ids), list(out), decoded, stats)


def eos_sources(model, tokenizer=None) -> dict[str, tuple[int, ...]]:
    """The EOS ids each source declares: ``generation_config.json``, ``config.json``, the tokenizer.

    The generator stops at any of them (a chat model's end-of-turn token is often only in one).

    Returns:
        ``{source name: ids}`` for the sources that declare any, in that order.
    """
    named = (
        ("generation_config.json", getattr(model, "generation_config", None)),
        ("config.json", getattr(model, "config", None)),
        ("the tokenizer", tokenizer),
    )
    out = {}
    for name, src in named:
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(eos, int):
            out[name] = (eos,)
        elif isinstance(eos, (list, tuple)) and eos:
            out[name] = tuple(int(e) for e in eos)
    return out


def eos_notice(model, tokenizer=None) -> str | None:
    """One line when the EOS sources disagree: slimspec stops at any of them, ``generate()`` at its own.

    transformers' ``generate()`` stops at ``generation_config.eos_token_id`` only (or ``config.json``'s
    where the model has no generation config), so for such a target its output can run past a token
    where slimspec's stops (docs/faults.md, "EOS").

    Returns:
        The notice, or None when every source declares the same ids.
    """
    found = eos_sources(model, tokenizer)
    if len({frozenset(ids) for ids in found.values()}) <= 1:
        return None
    every = sorted({i for ids in found.values() for i in ids})
    listed = ", ".join(f"{name} {list(ids)}" for name, ids in found.items())
    own = next(iter(found))
    return (
        f"EOS ids differ ({listed}): slimspec stops at any of {every}; transformers' generate() stops at "
        f"{own}'s {list(found[own])} only, so its outputs may run longer (docs/faults.md)"
    )
