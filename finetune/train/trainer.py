"""The training loop shared by ``slimspec finetune`` and ``slimspec train-drafter``.

Forward KL to the target over the full vocabulary (``--loss-vocab N``: over the N most frequent
answer tokens, the head frozen) with the training-time-test unroll
(slimspec_convert/model/ttt.py), AdamW with warmup + cosine decay, gradient clipping, held-out evaluation that
keeps the checkpoint with the best expected acceptance, periodic resumable checkpoints and
multi-process data parallelism through torch.distributed (torchrun / accelerate launch).
"""

from __future__ import annotations

import json
import logging
import math
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from finetune.config import FinetuneConfig
from finetune.train.distributed import all_reduce_sum, world
from finetune.train.features import FeatureCache
from finetune.train.loss import (
    ReferenceRows,
    expected_acceptance_terms,
    kl_terms,
    loss_vocabulary,
    reference_rows,
    top1_agreement,
    ttt_weights,
)
from finetune.train.params import export_drafter, set_trainable
from finetune.train.report import ONPOLICY_SCORE_KIND, TrainResult, log_evaluation
from slimspec_convert.atomic import atomic_path, atomic_write_json
from slimspec_convert.checkpoint.save import save_drafter
from slimspec_convert.data.examples import Example, batch_indices, collate, drawn_indices, token_counts
from slimspec_convert.devices import cpu_has_native_bf16
from slimspec_convert.model.drafter import Eagle3Drafter
from slimspec_convert.model.ttt import shift_left, ttt_unroll
from slimspec_convert.model.vocab import draft_to_target_ids
from slimspec_convert.targets.forward import target_forward, target_logits_at

logger = logging.getLogger(__name__)

STATE_NAME = "training_state.pt"
LOG_NAME = "train_log.jsonl"
REPORT_NAME = "finetune_report.json"


def _lr_lambda(cfg: FinetuneConfig):
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


class Trainer:
    """One fine-tune / training run.

    Args:
        drafter: the drafter to train (float32 recommended on CPU).
        target_model: HF causal LM (teacher and source of aux hidden states), eval mode.
        aux_layers: boundary ids to capture from the target.
        train_examples: tokenised training data.
        eval_examples: held-out data (never trained on).
        cfg: the run's config.
        out_dir: output folder (best drafter, checkpoints, logs).
        pad_id: padding token id.
        teacher_head: with ``cfg.teacher == 'drafter'``, the original dense head [V_d, d] module.
        meta: extra provenance written into the saved drafter's config.
        scorer: drafter -> an object with ``visited_tau`` and ``to_dict()`` (the on-policy chain
            metric, :func:`slimspec_convert.measure.chain_acceptance.chain_acceptance`); when given, its
            ``visited_tau`` (the tau of the rounds real greedy decoding runs on the held-out answers) is
            the selection score (the initial drafter included), else the teacher-forced chain score.
    """

    def __init__(
        self,
        drafter: Eagle3Drafter,
        target_model,
        aux_layers: tuple[int, ...],
        train_examples: list[Example],
        eval_examples: list[Example],
        cfg: FinetuneConfig,
        out_dir: str | Path,
        pad_id: int,
        teacher_head: nn.Module | None = None,
        meta: dict[str, Any] | None = None,
        scorer: Callable[[Eagle3Drafter], Any] | None = None,
    ) -> None:
        self.cfg = cfg
        self.target = target_model
        self.aux_layers = tuple(aux_layers)
        self.train_examples = train_examples
        self.eval_examples = eval_examples
        self.out = Path(out_dir)
        self.pad_id = pad_id
        self.meta = meta or {}
        self.rank, self.world = world()
        if cfg.batch_size % self.world:
            raise ValueError(f"batch_size={cfg.batch_size} is not divisible by the world size {self.world}")
        if cfg.teacher == "drafter" and teacher_head is None:
            raise ValueError("teacher='drafter' needs the original full head (teacher_head)")
        self.teacher_head = teacher_head
        self.scorer = scorer
        self.drafter = set_trainable(drafter, cfg)
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError(f"train={cfg.train!r} leaves no trainable parameter")
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, _lr_lambda(cfg))
        self.weights = ttt_weights(cfg.ttt_steps, cfg.ttt_decay)
        d2t = drafter.d2t
        self.draft_ids = draft_to_target_ids(d2t) if d2t is not None else None
        self.step = 0
        self.losses: list[float] = []
        self.history: list[dict[str, Any]] = []
        self.best: dict[str, Any] = {"score": -1.0}
        self.before: dict[str, Any] = {}
        self.device = next(drafter.parameters()).device
        self.target_head = target_model.get_output_embeddings()
        self.features = self._feature_cache()
        target_device = next(target_model.parameters()).device
        if target_device != self.device:
            raise ValueError(
                f"the drafter is on {self.device} but the target on {target_device}; put both on one device"
            )
        self.autocast = cfg.bf16_autocast and self.device.type == "cuda" and torch.cuda.is_bf16_supported()
        # On CPUs with bf16 matmul units the vocabulary-wide head products (most of a step's time)
        # run in bf16 with float32 softmax/KL; frozen dense heads keep one bf16 copy of their weight.
        self.bf16_heads = cfg.bf16_autocast and self.device.type == "cpu" and cpu_has_native_bf16()
        self._frozen_bf16: dict[int, Tensor] = {}
        self.loss_ids = (  # --loss-vocab N: the training KL's target ids (loss.loss_vocabulary)
            None
            if cfg.loss_vocab is None
            else loss_vocabulary(
                lambda v: token_counts(train_examples, v),
                cfg.loss_vocab,
                self._frozen_weight(self.drafter.lm_head),
                self.draft_ids,
            )
        )
        self._loss_rows: Tensor | None = None

    # ---- head products -----------------------------------------------------------------------
    def _head(self, head: nn.Module, x: Tensor) -> Tensor:
        """``head(x)`` as float32 logits: [N, d] -> [N, V]; in bf16 on CPUs with bf16 units."""
        if not self.bf16_heads:
            return head(x).float()
        wb = self._frozen_weight(head)
        if wb is not None:
            return F.linear(x.to(torch.bfloat16), wb).float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return head(x).float()

    def _frozen_weight(self, head: nn.Module) -> Tensor | None:
        """The weight of a frozen bias-free dense head in the dtype of its products, else None.

        Such a head (the target's embedding under ``train='body'``) takes the fused chunked
        head + KL (:meth:`ReferenceRows.head_kl`); a trainable or low-rank head keeps autograd.
        """
        w = getattr(head, "weight", None)
        if not isinstance(head, nn.Linear) or head.bias is not None or w.requires_grad:
            return None
        if not self.bf16_heads:
            return w
        wb = self._frozen_bf16.get(id(head))
        if wb is None:
            wb = self._frozen_bf16[id(head)] = w.detach().to(torch.bfloat16)
        return wb

    def _fused_head_weight(self) -> Tensor | None:
        """The frozen head weight the fused head + KL multiplies: every row, or with ``--loss-vocab``
        the rows of :attr:`loss_ids` ([N, d], sliced once per product dtype); None when the head
        is not frozen and dense."""
        weight = self._frozen_weight(self.drafter.lm_head)
        if weight is None or self.loss_ids is None:
            return weight
        if self._loss_rows is None or self._loss_rows.dtype != weight.dtype:
            self._loss_rows = weight.index_select(0, self.loss_ids)
        return self._loss_rows

    def _target_logits(self, final_hidden: Tensor) -> Tensor:
        """The target's logits at gathered final hidden states [N, dt] -> [N, V_t] float32."""
        if not self.bf16_heads:
            return target_logits_at(self.target, final_hidden)
        return target_logits_at(self.target, final_hidden, head=lambda x: self._head(self.target_head, x))

    # ---- one micro-batch -------------------------------------------------------------------
    def prepare_features(self) -> int:
        """Build the ``--feature-cache`` features not stored yet of every held-out example and of the
        training examples the run's ``steps * grad_accum`` batches draw (a run shorter than an epoch
        reads part of its data). Returns how many were added (0 without a feature cache)."""
        if self.features is None:
            return 0
        n, batches = len(self.train_examples), self.cfg.steps * self.cfg.grad_accum
        drawn = drawn_indices(n, self.cfg.batch_size, batches, self.cfg.seed)
        return self.features.build([self.train_examples[i] for i in drawn] + self.eval_examples)

    def _target(self, batch: dict[str, Tensor], examples: list[Example] | None = None):
        """The target's aux and final hidden states of a batch: from the feature cache, or a forward."""
        if self.features is not None and examples is not None:
            return self.features.target_output(examples, self.device)
        with torch.no_grad():  # logits are computed later, only where a loss needs them
            return target_forward(
                self.target,
                batch["input_ids"],
                self.aux_layers,
                attention_mask=batch["attention_mask"],
                logits_to_keep=1,
            )

    @torch.no_grad()
    def _target_reference(self, out, loss_mask: Tensor) -> ReferenceRows:
        """The target's next-token distribution at every position whose next token is supervised.

        Every TTT step reads its reference rows from here (step ``s`` at position ``t`` needs the
        target at ``t + 1 + s``, a row of the same set), so the target's head and softmax run once
        per batch instead of once per step.
        """
        need = shift_left(loss_mask.bool(), 1, False)  # q: token q + 1 supervised
        if out.final_lse is not None and self.loss_ids is not None:  # stored normaliser: loss rows only
            dtype = torch.bfloat16 if self.bf16_heads else self.target_head.weight.dtype
            t = self.cfg.teacher_temperature
            return self.features.loss_vocab_reference(out, need, self.loss_ids, dtype, t)
        b, t = need.nonzero(as_tuple=True)
        return reference_rows(
            self._sharpen(self._target_logits(out.final_hidden[b, t])),
            need,
            self.loss_ids if self.loss_ids is not None else self.draft_ids,
        )

    def _feature_cache(self) -> FeatureCache | None:
        """The ``--feature-cache`` folder's reader and builder (None without one)."""
        args = (self.cfg.feature_cache, self.target, self.aux_layers, self.pad_id)
        return FeatureCache(*args, logits_fn=self._target_logits) if self.cfg.feature_cache else None

    def _sharpen(self, ref_logits: Tensor) -> Tensor:
        """``--teacher-temperature`` T: the training reference's logits [..., V] divided by T (no copy at
        T = 1); the held-out metrics never pass through here."""
        t = self.cfg.teacher_temperature
        return ref_logits if t == 1.0 else ref_logits / t

    def _loss(
        self, batch: dict[str, Tensor], global_counts: Tensor, examples: list[Example] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Weighted sum over TTT steps of the masked-mean KL; returns (loss, per-step KL sums).

        Only supervised positions reach the heads (gathered first: prompt and padding positions
        are about half of chat data). The reference is the target (rows computed once per batch,
        :meth:`_target_reference`) or, with ``teacher='drafter'``, the original head on the
        drafter's own features of that step.
        """
        out = self._target(batch, examples)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        kl_sums = torch.zeros(self.cfg.ttt_steps, device=self.device)
        ref_rows = self._target_reference(out, batch["loss_mask"]) if self.teacher_head is None else None
        fused = self._fused_head_weight() if ref_rows is not None else None
        for st in ttt_unroll(
            self.drafter, batch["input_ids"], out.aux_hidden.float(), batch["loss_mask"], self.cfg.ttt_steps
        ):
            b, t = st.valid.nonzero(as_tuple=True)
            normed = self.drafter.norm(st.hidden[b, t])  # [N, d]
            if fused is not None:  # frozen dense head: chunked head + KL, no [N, V] autograd state
                kl = ref_rows.head_kl(b, t + st.ref_positions_shift, normed, fused)  # target at t + 1 + s
            elif ref_rows is not None:
                kl = ref_rows.kl(b, t + st.ref_positions_shift, self._head(self.drafter.lm_head, normed))
            else:
                draft_logits = self._head(self.drafter.lm_head, normed)  # [N, V_d]
                with torch.no_grad():
                    ref = self._sharpen(self._head(self.teacher_head, normed))  # original head, same features
                kl = kl_terms(ref, draft_logits)  # [N]
            total = total + self.weights[st.step] * kl.sum() / global_counts[st.step].clamp_min(1)
            kl_sums[st.step] = kl.detach().sum()
        return total, kl_sums

    def _valid_counts(self, batch: dict[str, Tensor]) -> Tensor:
        m = batch["loss_mask"]
        return torch.stack([shift_left(m, 2 + s, False).sum() for s in range(self.cfg.ttt_steps)]).float()

    def _local_examples(self, step: int, micro: int) -> list[Example]:
        global_step = step * self.cfg.grad_accum + micro
        idx = batch_indices(len(self.train_examples), self.cfg.batch_size, global_step, self.cfg.seed)
        per = self.cfg.batch_size // self.world
        return [self.train_examples[i] for i in idx[self.rank * per : (self.rank + 1) * per]]

    def _local_batch(self, step: int, micro: int) -> dict[str, Tensor]:
        return self._to_device(collate(self._local_examples(step, micro), self.pad_id))

    def _to_device(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def train_step(self) -> tuple[float, int]:
        """One optimizer step (grad_accum micro-batches). Returns (mean KL of step 0, tokens seen).

        Raises:
            ValueError: a NaN/inf KL (checked before the update, so the weights are left as they were).
        """
        self.drafter.train()
        self.opt.zero_grad(set_to_none=True)
        kl_sum = torch.zeros(self.cfg.ttt_steps, device=self.device)
        count_sum = torch.zeros(self.cfg.ttt_steps, device=self.device)
        tokens = torch.zeros((), dtype=torch.int64, device=self.device)  # summed on the device: no sync
        for micro in range(self.cfg.grad_accum):
            examples = self._local_examples(self.step, micro)
            batch = self._to_device(collate(examples, self.pad_id))
            counts = all_reduce_sum(self._valid_counts(batch))
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
                loss, kl_sums = self._loss(batch, counts, examples)
            (loss / self.cfg.grad_accum).backward()
            kl_sum += kl_sums
            count_sum += counts
            tokens += batch["attention_mask"].sum()
        if self.world > 1:
            for p in self.params:  # sum: each rank's loss was normalised by the global count
                if p.grad is not None:
                    dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            kl_sum = all_reduce_sum(kl_sum)
            tokens = all_reduce_sum(tokens)
        if not bool(torch.isfinite(kl_sum).all()):  # before the update: the weights stay as they were
            raise ValueError(
                f"finetune step {self.step + 1}: the KL per TTT step is {kl_sum.tolist()} (NaN/inf); the "
                "target's or the drafter's outputs are not finite (check their weights) or the lr is too high"
            )
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.clip_grad_norm)
        self.opt.step()
        self.sched.step()
        self.step += 1
        mean_kl = (kl_sum / count_sum.clamp_min(1)).tolist()  # the step's one host read
        self.losses.append(mean_kl[0])
        return mean_kl[0], int(tokens)

    # ---- evaluation --------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Held-out top-1 agreement and expected acceptance per TTT step, and the chain score.

        ``score`` = sum_s prod_{j<=s} acceptance_j: the expected number of accepted draft tokens
        of a chain of ``ttt_steps`` (the quantity the kept checkpoint maximises).
        """
        self.drafter.eval()
        acc_sum = torch.zeros(self.cfg.ttt_steps, device=self.device)
        top_sum = torch.zeros(self.cfg.ttt_steps, device=self.device)
        kl_sum = torch.zeros(self.cfg.ttt_steps, device=self.device)
        n_sum = torch.zeros(self.cfg.ttt_steps, device=self.device)
        n_eval = min(len(self.eval_examples), self.cfg.eval_batches * self.cfg.batch_size)
        per = max(1, self.cfg.batch_size // self.world)
        mine = list(range(n_eval))[self.rank :: self.world]
        for i in range(0, len(mine), per):
            examples = [self.eval_examples[j] for j in mine[i : i + per]]
            batch = self._to_device(collate(examples, self.pad_id))
            out = self._target(batch, examples)
            for st in ttt_unroll(
                self.drafter,
                batch["input_ids"],
                out.aux_hidden.float(),
                batch["loss_mask"],
                self.cfg.ttt_steps,
            ):
                b, t = st.valid.nonzero(as_tuple=True)
                ref = target_logits_at(self.target, out.final_hidden[b, t + st.ref_positions_shift])
                draft_logits = self.drafter.logits(st.hidden[b, t])  # [N, V_d]
                acc_sum[st.step] += expected_acceptance_terms(ref, draft_logits, self.draft_ids).sum()
                top_sum[st.step] += top1_agreement(ref, draft_logits, self.draft_ids).sum()
                kl_sum[st.step] += kl_terms(ref, draft_logits, self.draft_ids).sum()
                n_sum[st.step] += b.numel()
        for t in (acc_sum, top_sum, kl_sum, n_sum):
            all_reduce_sum(t)
        n = n_sum.clamp_min(1)
        acc = (acc_sum / n).tolist()
        score = sum(math.prod(acc[: s + 1]) for s in range(len(acc)))
        if not math.isfinite(score):  # a NaN score never beats the best: the run would save nothing
            raise ValueError(
                f"held-out evaluation at step {self.step}: acceptance {acc} is NaN/inf; the target's or "
                "the drafter's outputs are not finite (check their weights)"
            )
        metrics = {
            "step": self.step,
            "score": score,
            "score_kind": "teacher-forced expected accepted drafts (chain of ttt_steps)",
            "acceptance": acc,
            "top1": (top_sum / n).tolist(),
            "kl": (kl_sum / n).tolist(),
            "positions": int(n_sum[0].item()),
        }
        if self.scorer is not None:
            onpolicy = self.scorer(self.drafter)
            metrics.update(
                score=onpolicy.visited_tau,
                score_kind=ONPOLICY_SCORE_KIND,
                onpolicy=onpolicy.to_dict(),
            )
        return metrics

    # ---- checkpoints ---------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "trainable": {
                n: p.detach().clone() for n, p in self.drafter.named_parameters() if p.requires_grad
            },
            "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(),
            "losses": list(self.losses),
            "history_json": json.dumps(self.history),
            "best_json": json.dumps(self.best),
            "before_json": json.dumps(self.before),
            "rng": torch.get_rng_state(),
        }

    def save_checkpoint(self) -> None:
        """Write ``OUT/training_state.pt`` atomically (rank 0 only)."""
        if self.rank:
            return
        with atomic_path(self.out / STATE_NAME) as tmp:
            torch.save(self._state(), tmp)

    def load_checkpoint(self) -> bool:
        """Restore from ``OUT/training_state.pt`` (``weights_only=True``); False if none exists.

        Raises:
            ValueError: an unreadable or foreign state file, or a tensor this drafter lacks.
        """
        path = self.out / STATE_NAME
        if not path.is_file():
            return False
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except (RuntimeError, pickle.UnpicklingError, EOFError, OSError) as e:
            raise ValueError(
                f"{path}: cannot be read to resume ({_first_line(e)}); delete it or drop --resume"
            ) from e
        missing = sorted(set(self._state()) - set(state)) if isinstance(state, dict) else ["(not a dict)"]
        if missing:
            raise ValueError(
                f"{path}: not a training state of this trainer (missing {missing}); drop --resume"
            )
        params = dict(self.drafter.named_parameters())
        with torch.no_grad():
            for n, t in state["trainable"].items():
                if n not in params:
                    raise ValueError(
                        f"{path}: trainable tensor {n!r} does not exist in this drafter/--train mode"
                    )
                params[n].copy_(t)
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.losses = list(state["losses"])
        self.history = json.loads(state["history_json"])
        self.best = json.loads(state["best_json"])
        self.before = json.loads(state["before_json"])
        torch.set_rng_state(state["rng"])
        return True

    def _save_best(self, metrics: dict[str, Any]) -> None:
        self.best = metrics
        if self.rank:
            return
        meta = {**self.meta, "finetune": self.cfg.to_dict(), "heldout": metrics}
        save_drafter(export_drafter(self.drafter), self.out, extra_config={"training": meta})

    def selection(self) -> dict[str, Any]:
        """Which checkpoint was kept and whether the run improved on the initial drafter (its score)."""
        before, best = self.before.get("score"), self.best.get("score")
        return {
            "score_kind": self.best.get("score_kind"),
            "initial_score": before,
            "kept_score": best,
            "kept_step": self.best.get("step"),
            "improved": bool(before is not None and best is not None and best > before),
            "gain": None if before is None or best is None else best - before,
        }

    # ---- the run -------------------------------------------------------------------------------
    def run(self, resume: bool = False) -> TrainResult:
        """Train for ``cfg.steps`` optimizer steps (continuing from a checkpoint with resume)."""
        t0 = time.perf_counter()
        if self.rank == 0:
            self.prepare_features()
        if self.world > 1:
            dist.barrier()
            if self.features is not None and self.rank:  # rank 0 built the shards: read its manifest
                self.features = self._feature_cache()
        if resume and self.load_checkpoint():
            logger.info("resumed at step %d", self.step)
        if not self.before:
            self.before = self.evaluate()
            self.history.append(self.before)
            if self.before["score"] > self.best["score"]:
                self._save_best(self.before)
        log = (self.out / LOG_NAME).open("a") if self.rank == 0 else None
        tokens_total, train_seconds = 0, 0.0
        bar = tqdm(total=self.cfg.steps, initial=self.step, desc="train", unit="step", disable=self.rank != 0)
        try:
            while self.step < self.cfg.steps:
                ts = time.perf_counter()
                kl0, tokens = self.train_step()
                train_seconds += time.perf_counter() - ts
                tokens_total += tokens
                tps = tokens_total / max(train_seconds, 1e-9)
                bar.update(1)
                bar.set_postfix(kl=f"{kl0:.3f}", tok_s=f"{tps:.0f}", lr=f"{self.sched.get_last_lr()[0]:.1e}")
                if log:
                    log.write(json.dumps({"step": self.step, "kl_step0": kl0, "tokens_per_s": tps}) + "\n")
                    log.flush()
                if self.step % self.cfg.eval_every == 0 or self.step == self.cfg.steps:
                    metrics = self.evaluate()
                    self.history.append(metrics)
                    if metrics["score"] > self.best["score"]:
                        self._save_best(metrics)
                    log_evaluation(log, self.step, metrics, self.best)
                if self.step % self.cfg.save_every == 0 or self.step == self.cfg.steps:
                    self.save_checkpoint()
        finally:
            bar.close()
            if log:
                log.close()
        result = TrainResult(
            out_dir=str(self.out),
            steps=self.step,
            losses=self.losses,
            history=self.history,
            before=self.before,
            best=self.best,
            tokens_per_s=tokens_total / max(train_seconds, 1e-9),
            seconds=time.perf_counter() - t0,
            extra={"selection": self.selection()},
        )
        if self.rank == 0:
            atomic_write_json(self.out / REPORT_NAME, result.to_dict())
        return result


def _first_line(e: BaseException, limit: int = 160) -> str:
    line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."
