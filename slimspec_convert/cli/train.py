"""CLI commands: ``finetune`` (recover a converted drafter) and ``train-drafter`` (a new EAGLE-3 drafter).

Both run under ``torchrun --nproc_per_node N --no-python slimspec train-drafter ...`` for
data-parallel training; each process takes an equal slice of the global batch. Their defaults are
those of :class:`finetune.config.FinetuneConfig` (``finetune``) and
:meth:`FinetuneConfig.for_new_drafter` (``train-drafter``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated

import typer

from finetune.config import FinetuneConfig
from finetune.run import finetune as run_finetune
from finetune.run import train_drafter as run_train_drafter
from finetune.train.distributed import world
from slimspec_convert.cli.app import CHAT_HELP, command, config_fields

_F, _T = FinetuneConfig(), FinetuneConfig.for_new_drafter()

Data = Annotated[
    list[Path], typer.Option("--data", help="training file(s): JSONL/JSON conversations or prompts")
]
EvalData = Annotated[
    list[Path] | None, typer.Option("--eval-data", help="held-out file(s); default: a split")
]
Target = Annotated[str, typer.Option(help="target model folder, .gguf file or hub id")]
Out = Annotated[Path, typer.Option(help="output folder")]
Steps = Annotated[int, typer.Option(help="optimizer steps")]
Lr = Annotated[float, typer.Option(help="peak AdamW learning rate")]
TTT = Annotated[int, typer.Option("--ttt-steps", help="training-time-test unroll length K")]
Decay = Annotated[float, typer.Option("--ttt-decay", help="step-loss weight decay (0.8^s upstream)")]
TeacherT = Annotated[
    float,
    typer.Option(
        "--teacher-temperature",
        help="T of the training reference softmax(logits / T); T < 1 sharpens it toward the target's "
        "top-1 token (held-out metrics stay at T = 1)",
    ),
]
LossVocab = Annotated[
    int | None,
    typer.Option(
        "--loss-vocab",
        help="train='body': the training KL over the N target tokens most frequent in the training answers "
        "(fewer head products; the drafter keeps every token, held-out metrics stay full-vocabulary)",
    ),
]
Batch = Annotated[int, typer.Option("--batch-size", help="global sequences per micro-step")]
Accum = Annotated[int, typer.Option("--grad-accum", help="micro-steps per optimizer step")]
MaxLen = Annotated[int, typer.Option("--max-length", help="tokens per sequence (longer are truncated)")]
MaxAnswer = Annotated[
    int | None,
    typer.Option(
        "--max-answer-tokens",
        help="supervise only the first N tokens of each answer (where speculation starts and is hardest); "
        "default: every token",
    ),
]
EvalEvery = Annotated[int, typer.Option("--eval-every", help="held-out evaluation every M steps")]
EvalBatches = Annotated[int, typer.Option(help="held-out batches per evaluation")]
SaveEvery = Annotated[int, typer.Option("--save-every", help="resumable checkpoint every N steps")]
Warmup = Annotated[int, typer.Option(help="linear warmup steps")]
Seed = Annotated[int, typer.Option(help="data order / init seed")]
SplitSeed = Annotated[
    int, typer.Option(help="which examples / prompts are held out (kept apart from --seed across stages)")
]
Resume = Annotated[bool, typer.Option("--resume", help="continue from OUT/training_state.pt exactly")]
Force = Annotated[bool, typer.Option("--force", help="allow a non-empty OUT")]
SelfDistill = Annotated[
    bool, typer.Option("--self-distill", help="let the target answer prompt-only records")
]
JsonOut = Annotated[bool, typer.Option("--json", help="print the report as JSON")]
DataSource = Annotated[
    str,
    typer.Option(
        help="target: train on the target's own answers to the prompts of --data (distilled, cached in "
        "OUT); human: on the files' own answers (the old recipe)"
    ),
]
MetricPrompts = Annotated[int, typer.Option(help="held-out prompts of the on-policy chain metric")]
MetricDepth = Annotated[int, typer.Option(help="k of the greedy chain whose predicted tau selects")]
MeasurePrompts = Annotated[int, typer.Option(help="held-out prompts decoded for the measured tau (0 = skip)")]
Device = Annotated[str, typer.Option(help="auto (cuda when available), cpu, cuda or cuda:N")]
Dtype = Annotated[str, typer.Option(help="target dtype: auto (bf16 on CUDA, fp32 on CPU), fp32, bf16, fp16")]
FeatureCacheDir = Annotated[
    str | None,
    typer.Option(
        help="folder of the target's features, computed once (for the examples the run draws) and "
        "reused by every epoch and run"
    ),
]

Chat = Annotated[bool | None, typer.Option("--chat/--no-chat", help=CHAT_HELP)]


def _echo(result, json_out: bool) -> None:
    """Print the report once: in a multi-process run (torchrun) every rank holds it, rank 0 prints."""
    if world()[0] != 0:
        return
    typer.echo(json.dumps(result.to_dict(), indent=2) if json_out else result.summary())


@command()
def finetune(
    target: Target,
    drafter: Annotated[
        Path, typer.Option(help="drafter to fine-tune (e.g. the output of `slimspec convert`)")
    ],
    data: Data,
    out: Out,
    steps: Steps = _F.steps,
    lr: Lr = _F.lr,
    train: Annotated[str, typer.Option(help="head | head+lora | all | body")] = _F.train,
    teacher: Annotated[str, typer.Option(help="target | drafter")] = _F.teacher,
    teacher_drafter: Annotated[
        Path | None, typer.Option(help="original full-head drafter (--teacher drafter)")
    ] = None,
    ttt_steps: TTT = _F.ttt_steps,
    ttt_decay: Decay = _F.ttt_decay,
    teacher_temperature: TeacherT = _F.teacher_temperature,
    loss_vocab: LossVocab = _F.loss_vocab,
    batch_size: Batch = _F.batch_size,
    grad_accum: Accum = _F.grad_accum,
    max_length: MaxLen = _F.max_length,
    max_answer_tokens: MaxAnswer = _F.max_answer_tokens,
    eval_data: EvalData = None,
    eval_every: EvalEvery = _F.eval_every,
    eval_batches: EvalBatches = _F.eval_batches,
    save_every: SaveEvery = _F.save_every,
    warmup_steps: Warmup = _F.warmup_steps,
    seed: Seed = _F.seed,
    split_seed: SplitSeed = _F.split_seed,
    data_source: DataSource = _F.data_source,
    metric_prompts: MetricPrompts = _F.metric_prompts,
    metric_depth: MetricDepth = _F.metric_depth,
    measure_prompts: MeasurePrompts = _F.measure_prompts,
    device: Device = _F.device,
    dtype: Dtype = _F.dtype,
    feature_cache: FeatureCacheDir = _F.feature_cache,
    chat: Chat = _F.chat,
    resume: Resume = False,
    force: Force = False,
    self_distill: SelfDistill = False,
    json_out: JsonOut = False,
) -> None:
    """Short KL recovery fine-tune of a (low-rank) drafter against the target (training-time test)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = FinetuneConfig(**config_fields(FinetuneConfig, locals()))
    result = run_finetune(
        target,
        drafter,
        data,
        out,
        cfg,
        eval_data=eval_data,
        teacher_drafter=teacher_drafter,
        resume=resume,
        force=force,
        self_distill=self_distill,
    )
    _echo(result, json_out)


@command("train-drafter")
def train_drafter(
    target: Target,
    data: Data,
    out: Out,
    draft_vocab_size: Annotated[
        int | None,
        typer.Option(help="trim the draft vocabulary to the N most frequent training tokens (default: full)"),
    ] = None,
    steps: Steps = _T.steps,
    lr: Lr = _T.lr,
    train: Annotated[str, typer.Option(help="all | body (head frozen at the target's)")] = _T.train,
    ttt_steps: TTT = _T.ttt_steps,
    ttt_decay: Decay = _T.ttt_decay,
    teacher_temperature: TeacherT = _T.teacher_temperature,
    loss_vocab: LossVocab = _T.loss_vocab,
    batch_size: Batch = _T.batch_size,
    grad_accum: Accum = _T.grad_accum,
    max_length: MaxLen = _T.max_length,
    max_answer_tokens: MaxAnswer = _T.max_answer_tokens,
    eval_data: EvalData = None,
    eval_every: EvalEvery = _T.eval_every,
    eval_batches: EvalBatches = _T.eval_batches,
    save_every: SaveEvery = _T.save_every,
    warmup_steps: Warmup = _T.warmup_steps,
    seed: Seed = _T.seed,
    split_seed: SplitSeed = _T.split_seed,
    data_source: DataSource = _T.data_source,
    metric_prompts: MetricPrompts = _T.metric_prompts,
    metric_depth: MetricDepth = _T.metric_depth,
    measure_prompts: MeasurePrompts = _T.measure_prompts,
    device: Device = _T.device,
    dtype: Dtype = _T.dtype,
    feature_cache: FeatureCacheDir = _T.feature_cache,
    chat: Chat = _T.chat,
    resume: Resume = False,
    force: Force = False,
    self_distill: SelfDistill = False,
    json_out: JsonOut = False,
) -> None:
    """Train a new EAGLE-3 drafter for a target (head and embeddings initialised from the target)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = FinetuneConfig.for_new_drafter(**config_fields(FinetuneConfig, locals()))
    result = run_train_drafter(
        target,
        data,
        out,
        cfg,
        draft_vocab_size=draft_vocab_size,
        eval_data=eval_data,
        resume=resume,
        force=force,
        self_distill=self_distill,
    )
    _echo(result, json_out)
