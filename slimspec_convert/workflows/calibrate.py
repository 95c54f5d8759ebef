"""Calibration statistics for ``slimspec convert --calibration-data``: the second moment of the
drafter's lm_head input on real text, as seen during drafting (every TTT step).

:func:`~slimspec_convert.lowrank.calibrated.calibrated_factorize` uses it to pick the rank-r head that
minimises the expected logit error rather than the weight error.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from slimspec_convert.checkpoint.load import load_drafter
from slimspec_convert.data.distill import DistillConfig, distill, is_distilled, read_prompts
from slimspec_convert.data.examples import Example, collate, load_examples, token_counts
from slimspec_convert.lowrank.calibrated import HeadCalibration, token_row_weights
from slimspec_convert.model.drafter import Eagle3Drafter
from slimspec_convert.model.ttt import ttt_unroll
from slimspec_convert.model.vocab import draft_to_target_ids
from slimspec_convert.targets.forward import resolve_aux_layers, target_forward
from slimspec_convert.targets.load import load_target

# slimspec convert --calibration-data: conversations sampled from the files
DEFAULT_CALIBRATION_SAMPLES = 64


DEFAULT_CALIBRATION_TTT_STEPS = 3


DEFAULT_CALIBRATION_MAX_LENGTH = 256


# --calibration-source target: the target answers the sampled prompts (greedy) with at most this many tokens.
DEFAULT_CALIBRATION_NEW_TOKENS = 192


CALIBRATION_SOURCES = ("target", "human")


def check_calibration_source(owner: str, source: str) -> None:
    """Raises ValueError naming ``owner`` (e.g. ``ConvertConfig.calibration_source``) when ``source``
    is not one of :data:`CALIBRATION_SOURCES`."""
    if source not in CALIBRATION_SOURCES:
        raise ValueError(f"{owner}={source!r}: expected one of {', '.join(CALIBRATION_SOURCES)}")


# The built-in calibration set of ``slimspec convert --target T`` without --calibration-data: committed
# *training* data (data/README.md; never data/eval). The main job calibrates on the same two files.
TRAIN_DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "train"


DEFAULT_CALIBRATION_FILES = ("gsm8k/train.jsonl", "gpteacher/codegen-instruct.json")


def default_calibration_files(root: Path = TRAIN_DATA_DIR) -> tuple[str, ...]:
    """The built-in calibration files (GSM8K train, GPTeacher codegen) under the repository's data/train.

    Args:
        root: the training-data folder (default: ``data/train`` of this checkout).

    Returns:
        Their paths, in :data:`DEFAULT_CALIBRATION_FILES` order.

    Raises:
        FileNotFoundError: a file is missing (a wheel install ships no data/), naming the fixes.
    """
    paths = tuple(str(root / name) for name in DEFAULT_CALIBRATION_FILES)
    missing = [p for p in paths if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(
            f"built-in calibration data {missing} not found (data/train ships with the git checkout, "
            "not with a wheel); pass --calibration-data FILE (training conversations) or --no-calibration"
        )
    return paths


@torch.no_grad()
def head_input_moment(
    drafter: Eagle3Drafter,
    target_model,
    examples: list[Example],
    *,
    pad_id: int,
    ttt_steps: int = DEFAULT_CALIBRATION_TTT_STEPS,
    batch_size: int = 4,
    source: str = "",
) -> HeadCalibration:
    """``E[h h^T]`` of the normed drafter hidden state ``h`` (the lm_head input) on real data.

    The drafter is unrolled exactly as in training-time test (:func:`~slimspec_convert.model.ttt.ttt_unroll`):
    step s sees its own step s-1 outputs, so the moment covers the states met deeper in a
    draft too. Only supervised positions (assistant tokens whose prediction target exists) count.

    Args:
        drafter: the source drafter (its dense head is not used), float32 recommended, on the
            target's device (batches are moved there).
        target_model: HF causal LM providing the aux hidden states.
        examples: tokenised calibration examples.
        pad_id: padding token id.
        ttt_steps: unrolled steps K >= 1.
        batch_size: sequences per target forward.
        source: description for the report.

    Returns:
        :class:`~slimspec_convert.lowrank.calibrated.HeadCalibration` with a [d, d] float64 moment (on
        the CPU).

    Raises:
        ValueError: no example, or no supervised position in them.
    """
    if not examples:
        raise ValueError("calibration: no example to compute the head-input statistics from")
    aux = resolve_aux_layers(drafter.config, target_model)
    drafter.eval()
    d = drafter.config.hidden_size
    device = next(drafter.parameters()).device
    moment = torch.zeros(d, d, dtype=torch.float64, device=device)
    rows = 0
    for i in tqdm(range(0, len(examples), batch_size), desc="calibrate", unit="batch"):
        batch = {k: v.to(device) for k, v in collate(examples[i : i + batch_size], pad_id).items()}
        out = target_forward(
            target_model, batch["input_ids"], aux, attention_mask=batch["attention_mask"], logits_to_keep=1
        )
        for st in ttt_unroll(
            drafter, batch["input_ids"], out.aux_hidden.float(), batch["loss_mask"], ttt_steps
        ):
            b, t = st.valid.nonzero(as_tuple=True)
            h = drafter.norm(st.hidden[b, t]).to(torch.float64)  # [N, d]
            moment.addmm_(h.T, h)
            rows += h.shape[0]
    if rows == 0:
        raise ValueError("calibration: the examples have no supervised (assistant) position")
    return HeadCalibration(second_moment=(moment / rows).cpu(), rows=rows, source=source)


def calibrate_from_files(
    src: str | Path,
    target: str | Path,
    data: list[str | Path],
    *,
    samples: int = DEFAULT_CALIBRATION_SAMPLES,
    max_length: int = DEFAULT_CALIBRATION_MAX_LENGTH,
    ttt_steps: int = DEFAULT_CALIBRATION_TTT_STEPS,
    seed: int = 0,
    device: str = "cpu",
    dtype: str | None = None,
    source: str = "target",
    new_tokens: int = DEFAULT_CALIBRATION_NEW_TOKENS,
) -> HeadCalibration:
    """Load the target, the source drafter and ``samples`` random conversations; return the moment.

    With ``source="target"`` (the default) the conversations are the target's own greedy answers
    to ``samples`` prompts drawn from ``data`` (:func:`~slimspec_convert.data.distill.distill`,
    in a temporary file), the text the drafter meets in speculative decoding; files that
    ``slimspec distill`` wrote are used as they are. ``source="human"`` takes the files' own
    answers.

    Args:
        src: source drafter folder (any layout :func:`~slimspec_convert.convert.load_drafter` reads).
        target: target folder / GGUF / hub id (aux hidden states and tokenizer).
        data: training-format files (the formats ``slimspec finetune --data`` reads).
        samples: conversations to use (drawn with ``seed``; all when fewer).
        max_length: tokens per conversation (truncated).
        ttt_steps: unrolled drafter steps.
        seed: sampling seed.
        device: where the target and the drafter run (``auto``, ``cpu``, ``cuda``, ``cuda:N``).
        dtype: the target's dtype (``auto``/None: bfloat16 on CUDA, float32 on the CPU); the
            drafter runs in float32 and the moment accumulates in float64 either way.
        source: ``target`` (the target answers the prompts) or ``human`` (the files' answers).
        new_tokens: answer length cap with ``source="target"``.

    Returns:
        :class:`~slimspec_convert.lowrank.calibrated.HeadCalibration`.

    Raises:
        FileNotFoundError, ValueError: missing files, bad data or drafter (messages name the file).
    """

    if samples < 1:
        raise ValueError(f"--calibration-samples={samples}: expected >= 1")
    check_calibration_source("--calibration-source", source)
    model, tok = load_target(target, dtype, device)
    drafter, _ = load_drafter(src, target=model)
    g = torch.Generator().manual_seed(seed)
    names = ", ".join(map(str, data))
    if source == "target" and not is_distilled(list(data)):
        prompts = read_prompts(list(data))
        pick = torch.randperm(len(prompts), generator=g)[:samples].tolist()
        with tempfile.TemporaryDirectory(prefix="slimspec-calibration-") as tmp:
            answers = Path(tmp) / "answers.jsonl"
            keys = {(prompts[i].source, prompts[i].line) for i in pick}
            distill(model, tok, list(data), answers, DistillConfig(max_new_tokens=new_tokens), only=keys)
            chosen, _ = load_examples(tok, [answers], max_length)
        what = f"the target's greedy answers (<= {new_tokens} new tokens) to {len(chosen)} prompts"
    else:
        examples, _ = load_examples(tok, list(data), max_length)
        pick = torch.randperm(len(examples), generator=g)[:samples].tolist()
        chosen = [examples[i] for i in pick]
        what = f"{len(chosen)} conversations"
    moment = head_input_moment(
        drafter.float().to(model.device),
        model,
        chosen,
        pad_id=tok.pad_token_id,
        ttt_steps=ttt_steps,
        source=f"{what} (<= {max_length} tokens, {ttt_steps} TTT steps) of {names}",
    )
    return dataclasses.replace(moment, token_counts=token_counts(chosen, drafter.config.vocab_size))


def head_row_weights(
    calibration: HeadCalibration, rows: int, d2t: Tensor | None, mix: float
) -> Tensor | None:
    """Row weights of the head being factorised (see ``lowrank.calibrated.token_row_weights``).

    Args:
        calibration: with ``token_counts`` [V_t] (None: no weighting).
        rows: the head's rows (V_t for a full-vocabulary head, V_d for a trimmed one).
        d2t: [V_d] EAGLE-3 offsets of a trimmed head (row i is target token i + d2t[i]), else None.
        mix: frequency share of the weights; 0 = unweighted (returns None).

    Returns:
        [rows] float64 weights, or None.

    Raises:
        ValueError: counts that neither match the rows nor map onto them through ``d2t``.
    """
    if calibration.token_counts is None or mix == 0:
        return None
    counts = calibration.token_counts
    if rows != counts.numel():
        if d2t is None or d2t.numel() != rows:
            raise ValueError(
                f"calibration token counts cover {counts.numel()} target tokens, the head has {rows} rows "
                "and no d2t maps them; pass --calibration-token-weight 0"
            )
        counts = counts[draft_to_target_ids(d2t)]
    return token_row_weights(counts, mix)
