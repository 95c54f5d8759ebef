"""Fine-tune / train-drafter configuration (frozen dataclass; every default written once, here)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from slimspec_convert.devices import AUTO_DTYPE, check_device_name, check_run_dtype

TRAIN_CHOICES = ("head", "head+lora", "all", "body")
TEACHER_CHOICES = ("target", "drafter")
DATA_SOURCES = ("target", "human")  # train on the target's own answers (on-policy) or on the files' answers


# Upstream defaults (eagle3-formats.md section 7): SpecForge / EAGLE unroll 7 steps, weights 0.8^s.
# train-drafter keeps them; the recovery fine-tune's own defaults below come from a sweep.
DEFAULT_TTT_STEPS = 7
DEFAULT_TTT_DECAY = 0.8

# The recovery recipe (slimspec finetune): the best of a small sweep on the SmolLM2 demo drafter's
# calibrated rank-72 convert, scored by the on-policy predicted chain-3 tau on 16 held-out training
# prompts (README at 8de2c04, "Fine-tuning"): lr 4e-4 / 1e-3 / 2e-3 at 3 TTT steps gave 1.493 / 1.558 / 1.581
# (from 1.348) in 60 steps; 5 TTT steps at 2e-3 gave 1.588 (+0.5%) for 1.5x the step time, so 3 stay.
# Steps: one 180-step run of these defaults on the stage-7 demo drafter's calibrated rank-72 convert,
# scored every 20 steps: 1.550 (step 0) / 1.668 / 1.714 / 1.719 / 1.720 / 1.774 (step 100) / 1.768 /
# 1.789 / 1.787 / 1.786 (step 180): a plateau from about step 100, so 100 steps (about 7 minutes on
# 2 CPU cores; 60 gave 1.722). 120 steps made the main job 19.0 minutes on a slow day: too near 20.
RECOVERY_STEPS = 100
RECOVERY_LR = 2e-3
RECOVERY_TTT_STEPS = 3
RECOVERY_MAX_LENGTH = 256
RECOVERY_WARMUP_STEPS = 5
RECOVERY_EVAL_EVERY = 20


@dataclass(frozen=True)
class FinetuneConfig:
    """Options of ``slimspec finetune`` and ``slimspec train-drafter``.

    ``train`` selects the trainable parameters: ``head`` (the lm_head only, the SlimSpec recovery
    default), ``head+lora`` (head plus LoRA adapters on the decoder layer, peft), ``all`` (every
    drafter parameter except the frozen embeddings) or ``body`` (everything but head and
    embeddings: the drafter learns to use a frozen head, as speculators does since 2026-04).
    ``batch_size`` is the global batch per optimizer micro-step; with ``grad_accum`` G the
    optimizer sees ``batch_size * G`` sequences. In multi-process runs each rank takes an equal
    slice of the global batch. ``device`` places the target and the drafter; ``dtype`` is the
    target's (the teacher); the drafter's trained parameters stay float32, under bf16 autocast on
    CUDA (``bf16_autocast``). ``teacher_temperature`` T divides the reference logits in the training
    loss only (``KL(softmax(z_ref / T) || draft)``; T < 1 puts the target's top-1 token nearer one
    hot, the token greedy verification accepts); held-out metrics always use the target at T = 1.
    ``loss_vocab`` N restricts the *training* KL to the N target tokens most frequent among the
    training answers (``train='body'``, a frozen full-vocabulary head): the head's products and
    softmax run over those N rows only (SpecForge / FR-Spec trim the draft vocabulary the same way,
    but here only the loss is trimmed: the drafter keeps every token, and the held-out metrics stay
    over the full vocabulary).
    """

    steps: int = RECOVERY_STEPS
    lr: float = RECOVERY_LR  # the paper's AdamW 4e-4 was the weakest of the sweep here
    train: str = "head"
    teacher: str = "target"
    teacher_temperature: float = 1.0  # the reference is softmax(logits / T); T < 1 sharpens it
    loss_vocab: int | None = None  # training KL over the N most frequent answer tokens (None: every token)
    ttt_steps: int = RECOVERY_TTT_STEPS
    ttt_decay: float = DEFAULT_TTT_DECAY
    batch_size: int = 4
    grad_accum: int = 1
    max_length: int = RECOVERY_MAX_LENGTH
    max_answer_tokens: int | None = None  # supervise each answer's first N tokens only (None: all)
    warmup_steps: int = RECOVERY_WARMUP_STEPS
    weight_decay: float = 0.0
    clip_grad_norm: float = 0.5  # paper: clip 0.5
    eval_every: int = RECOVERY_EVAL_EVERY
    eval_batches: int = 4
    save_every: int = RECOVERY_EVAL_EVERY
    seed: int = 0  # data order, initialisation
    split_seed: int = 0  # which examples or prompts are held out, apart from seed (stages keep one split)
    lora_rank: int = 16
    lora_alpha: int = 32
    num_workers_hint: int = 0
    bf16_autocast: bool = True  # CUDA: autocast; CPUs with bf16 units: the head products in bf16
    max_eval_fraction: float = 0.05  # held-out share of the data when no --eval-data is given
    data_source: str = "target"  # on-policy: the target answers the prompts of --data (distilled, cached)
    metric_prompts: int = 16  # held-out prompts the target answers for the on-policy chain metric
    metric_depth: int = 3  # k of the greedy chain whose predicted tau selects the kept checkpoint
    metric_new_tokens: int = 64  # answer length of the metric's held-out prompts
    measure_prompts: int = 4  # held-out prompts decoded for the final measured tau (0 = skip)
    distill_new_tokens: int = 256  # answer length cap of the distilled training data
    device: str = "auto"  # cuda when available, else cpu (target and drafter)
    dtype: str = AUTO_DTYPE  # the target's dtype: bfloat16 on CUDA, float32 on the CPU
    chat: bool | None = None  # chat template / completion records and prompts; None: the tokenizer decides
    feature_cache: str | None = (
        None  # folder of the target's features, computed once (finetune/train/features.py)
    )

    def __post_init__(self) -> None:
        if self.train not in TRAIN_CHOICES:
            raise ValueError(f"FinetuneConfig.train={self.train!r}: expected one of {TRAIN_CHOICES}")
        if self.teacher not in TEACHER_CHOICES:
            raise ValueError(f"FinetuneConfig.teacher={self.teacher!r}: expected one of {TEACHER_CHOICES}")
        if self.teacher == "drafter" and self.train != "head":
            raise ValueError(
                f"FinetuneConfig.teacher='drafter' distils the original head and needs train='head' "
                f"(got train={self.train!r})"
            )
        for name in (
            "steps",
            "ttt_steps",
            "batch_size",
            "grad_accum",
            "max_length",
            "eval_every",
            "eval_batches",
            "save_every",
            "lora_rank",
            "lora_alpha",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"FinetuneConfig.{name}={value!r}: expected an integer >= 1")
        if self.max_length < 4:
            raise ValueError(f"FinetuneConfig.max_length={self.max_length}: expected >= 4")
        if self.max_answer_tokens is not None and (
            not isinstance(self.max_answer_tokens, int) or self.max_answer_tokens < 1
        ):
            raise ValueError(
                f"FinetuneConfig.max_answer_tokens={self.max_answer_tokens!r}: expected an integer >= 1 "
                "or None"
            )
        if not self.lr > 0:
            raise ValueError(f"FinetuneConfig.lr={self.lr}: expected > 0")
        if not 0 < self.ttt_decay <= 1:
            raise ValueError(f"FinetuneConfig.ttt_decay={self.ttt_decay}: expected 0 < decay <= 1")
        if not (math.isfinite(self.teacher_temperature) and self.teacher_temperature > 0):
            raise ValueError(
                f"FinetuneConfig.teacher_temperature={self.teacher_temperature}: expected a finite T > 0"
            )
        if self.loss_vocab is not None:
            if not isinstance(self.loss_vocab, int) or self.loss_vocab < 1:
                raise ValueError(
                    f"FinetuneConfig.loss_vocab={self.loss_vocab!r}: expected an integer >= 1 or None"
                )
            if self.train != "body" or self.teacher != "target":
                raise ValueError(
                    f"FinetuneConfig.loss_vocab={self.loss_vocab} trims the loss of a frozen full head: it "
                    f"needs train='body' and teacher='target' (got train={self.train!r}, "
                    f"teacher={self.teacher!r})"
                )
        if self.warmup_steps < 0:
            raise ValueError(f"FinetuneConfig.warmup_steps={self.warmup_steps}: expected >= 0")
        if self.data_source not in DATA_SOURCES:
            raise ValueError(
                f"FinetuneConfig.data_source={self.data_source!r}: expected one of {DATA_SOURCES}"
            )
        for name in ("metric_prompts", "metric_depth", "metric_new_tokens", "distill_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"FinetuneConfig.{name}={getattr(self, name)}: expected >= 1")
        if not 0 <= self.measure_prompts <= self.metric_prompts:
            raise ValueError(
                f"FinetuneConfig.measure_prompts={self.measure_prompts}: expected 0 <= N <= "
                f"metric_prompts={self.metric_prompts} (they are the first held-out prompts)"
            )
        check_device_name("FinetuneConfig", self.device)
        check_run_dtype("FinetuneConfig", self.dtype)
        if not 0 < self.max_eval_fraction < 1:
            raise ValueError(f"FinetuneConfig.max_eval_fraction={self.max_eval_fraction}: expected in (0, 1)")

    @classmethod
    def for_new_drafter(cls, **changes: Any) -> FinetuneConfig:
        """The defaults of ``train-drafter``: a fresh drafter trains every parameter (``train='all'``)
        at lr 1e-3 for 200 steps with the upstream 7-step TTT unroll on 512-token sequences, not
        the short recovery recipe; ``changes`` override fields."""
        fresh = dict(lr=1e-3, train="all", steps=200, ttt_steps=DEFAULT_TTT_STEPS, max_length=512)
        fresh.update(warmup_steps=10, eval_every=50, save_every=50)
        return cls(**{**fresh, **changes})

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> FinetuneConfig:
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)
