"""``slimspec bench e2e`` and ``bench head`` as workflows: paths in, results written, data returned."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

from slimspec_convert.atomic import atomic_write_bytes, atomic_write_json
from slimspec_convert.checkpoint.folders import read_config
from slimspec_convert.checkpoint.load import load_drafter_with_target_embeddings
from slimspec_convert.checkpoint.names import CONFIG_NAME, SLIMSPEC_SECTION
from slimspec_convert.decoding.config import AUTO_DRAFT
from slimspec_convert.decoding.prompts import load_prompts, prompt_kinds
from slimspec_convert.measure.draft_shape import default_calibration_file
from slimspec_convert.measure.e2e import BenchE2EConfig, E2EResult, run_e2e
from slimspec_convert.measure.head_latency import PAPER_HEAD_SHAPES
from slimspec_convert.measure.plots import plot_predicted_vs_measured
from slimspec_convert.measure.provenance import provenance
from slimspec_convert.measure.tables import e2e_markdown
from slimspec_convert.targets.load import load_target, resolve_chat

E2E_JSON, E2E_MD, E2E_PNG = "e2e.json", "e2e.md", "e2e_speedup.png"


def head_shape_from_config(raw: Mapping, where: str = CONFIG_NAME) -> tuple[int, int]:
    """(d, V_d) of a drafter's head from its parsed config.json (SlimSpec section or flat HF keys).

    Args:
        raw: the parsed config.json.
        where: name used in messages.

    Returns:
        (hidden_size, draft_vocab_size); V_d falls back to ``vocab_size`` when untrimmed.

    Raises:
        ValueError: neither layout names the hidden size.
    """
    section = raw.get(SLIMSPEC_SECTION, {}).get("drafter_config")
    src = section if section else raw
    if "hidden_size" not in src:
        raise ValueError(
            f"{where}: no 'hidden_size' (flat or in the slimspec section); pass --hidden-size/--vocab-size"
        )
    vocab = src.get("draft_vocab_size") or src.get("vocab_size")
    if not vocab:
        raise ValueError(f"{where}: no 'draft_vocab_size' or 'vocab_size'; pass --hidden-size/--vocab-size")
    return int(src["hidden_size"]), int(vocab)


def head_shapes(
    drafter: str | Path | None = None, hidden_size: int | None = None, vocab_size: int | None = None
) -> tuple[tuple[int, int], ...]:
    """The (d, V) head shapes ``bench head`` times: a drafter's, one given shape, or the paper's three.

    Args:
        drafter: a drafter folder (its config.json gives d and V_d).
        hidden_size, vocab_size: one shape, given together.

    Returns:
        ((d, V), ...): the drafter's shape, the given one, or :data:`PAPER_HEAD_SHAPES`.

    Raises:
        ValueError: a drafter and a shape both given, or only one of hidden_size / vocab_size.
        FileNotFoundError: no config.json in the drafter folder.
    """
    if drafter is not None:
        if hidden_size is not None or vocab_size is not None:
            raise ValueError("give --drafter or --hidden-size/--vocab-size, not both")
        folder = Path(drafter)
        return (head_shape_from_config(read_config(folder), str(folder / CONFIG_NAME)),)
    if (hidden_size is None) != (vocab_size is None):
        raise ValueError("--hidden-size and --vocab-size go together")
    if hidden_size is not None:
        return ((hidden_size, vocab_size),)
    return tuple(PAPER_HEAD_SHAPES.values())


def write_e2e(result: E2EResult, out_dir: Path, force: bool = False) -> list[Path]:
    """Write e2e.json, e2e.md and e2e_speedup.png into ``out_dir``.

    The plot has tokens/s relative to plain decoding for every row (plain = 1.0) beside predicted
    vs measured rho_TPS (relative to the full-head drafter) for the drafters the cost model covers.

    Raises:
        FileExistsError: an output exists and force is off.
    """
    paths = [out_dir / n for n in (E2E_JSON, E2E_MD, E2E_PNG)]
    existing = [str(p) for p in paths if p.exists()]
    if existing and not force:
        raise FileExistsError(f"{existing} exist; pass --force to overwrite")
    atomic_write_json(paths[0], result.to_dict())
    atomic_write_bytes(paths[1], e2e_markdown(result).encode())
    rows = [r for r in result.rows if r.predicted_rho_tps is not None]
    plot_predicted_vs_measured(
        [r.name for r in rows],
        [r.predicted_rho_tps for r in rows],
        [r.measured_rho_tps for r in rows],
        paths[2],
        speedup_names=[r.name for r in result.rows],  # plain decoding first, at 1.0
        speedup_vs_plain=[r.speedup for r in result.rows],
    )
    return paths


def bench_e2e(
    target: str | Path,
    prompts_path: str | Path,
    out: str | Path,
    cfg: BenchE2EConfig,
    progress: Callable[[str], None] | None = None,
    command: str | None = None,
) -> E2EResult:
    """``slimspec bench e2e``: load the target and drafters, run, write JSON + markdown + PNG.

    The JSON carries a ``provenance`` block (:func:`~slimspec_convert.measure.provenance.provenance`:
    date, ``command``, versions, host), which ``scripts/make_docs.py`` cites.

    Raises:
        FileExistsError: outputs exist and ``cfg.force`` is off.
        FileNotFoundError: missing target, drafter or prompt file.
        ValueError: bad prompts, drafters that do not fit the target.
    """

    out = Path(out)
    if not cfg.force and any((out / n).exists() for n in (E2E_JSON, E2E_MD, E2E_PNG)):
        raise FileExistsError(f"{out}: holds e2e results; pass --force to overwrite")
    prompts = [turns[0] for turns in load_prompts(prompts_path)][: cfg.max_prompts]
    kinds = prompt_kinds(prompts_path)[: len(prompts)]
    model, tokenizer = load_target(target, cfg.dtype, cfg.device)
    mode = resolve_chat(tokenizer, cfg.chat)
    if progress is not None:
        progress(mode.summary())
    cfg = replace(cfg, chat=mode.chat)
    drafters = {
        n: load_drafter_with_target_embeddings(p, model).to(device=model.device, dtype=model.dtype).eval()
        for n, p in cfg.drafters
    }
    for name, k in cfg.rerank:
        try:
            drafters[name].enable_rerank(k, cfg.rerank_context)
        except ValueError as e:
            raise ValueError(f"--rerank {name}={k}: {dict(cfg.drafters)[name]}: {e}") from e
    result = run_e2e(model, tokenizer, drafters, prompts, cfg, progress, kinds=kinds)
    default = default_calibration_file(cfg.chat)
    held_out = default.relative_to(default.parents[2])  # data/heldout/<file>.jsonl
    calibration = "none" if cfg.draft_method != AUTO_DRAFT else (cfg.auto_prompts or str(held_out))
    where = f"the first {len(prompts)} of {prompts_path}; draft shapes planned on {calibration}"
    made = provenance(command or "(library call)", str(target), where)
    result = replace(result, provenance=made)
    write_e2e(result, out, force=cfg.force)
    return result
