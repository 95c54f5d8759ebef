"""Rebuild every generated figure in the docs from the committed results JSON.

Figures are never typed by hand: each table in ``docs/results.md``, the README's headline table and the
demo drafters' evaluation tables are made here from the JSON a benchmark wrote (``results/``), and
``tests/unit/test_docs.py`` runs this script with ``--check`` so that a page can never drift from its
run.

Usage::

    python scripts/make_docs.py           # rewrite the generated pages and blocks
    python scripts/make_docs.py --check   # exit 1 (and print a diff) if any of them differs

A generated block inside a hand-written page sits between ``<!-- BEGIN generated: NAME -->`` and
``<!-- END generated: NAME -->``; everything outside the markers is left alone.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"

# A results file and how the results page introduces it: (path under results/, title, what it shows).
SECTIONS: list[tuple[str, str, str]] = [
    (
        "smollm2/mainjob.json",
        "SmolLM2-135M-Instruct: the main job",
        "`bash examples/quickstart.sh`: the committed demo drafter (full head), its 16k trimmed copy and "
        "its SlimSpec conversion (r = d/8 = 72, calibrated, the default 100-step recovery fine-tune), "
        "with and without the shortlist rerank, against plain decoding, interleaved on the same prompts.",
    ),
]
KIND_ORDER = ["writing", "qa", "math", "translation", "code", "summarisation"]
# The large-vocabulary job (examples/gemma3_job.sh): its defaults run and its one-shape cost-model run.
GEMMA_JOB = "gemma3/job.json"
GEMMA_CHAIN3 = "gemma3/job_chain3.json"
GEMMA_TITLE = "Gemma 3 270M (V = 262,144): the large-vocabulary job"
GEMMA_SWEEP = "gemma3/rank_sweep.json"  # the job's rank sweep (slimspec rank-sweep)
GEMMA_TRAINING = "gemma3/drafter_training.json"  # the demo drafter's train-drafter run
# its continuations (slimspec finetune), each from the previous run's kept checkpoint, where they ran
GEMMA_CONTINUATIONS = (
    "gemma3/drafter_finetune.json",
    "gemma3/drafter_finetune2.json",
    "gemma3/drafter_finetune3.json",
    "gemma3/drafter_finetune4.json",
)
GEMMA_CARD = ROOT / "drafters" / "gemma3-270m-eagle3" / "README.md"


def load(rel: str) -> dict:
    """One results JSON, read from ``results/REL``; KeyError-free access is the caller's job."""
    return json.loads((RESULTS / rel).read_text(encoding="utf-8"))


def fmt(x: float | None, digits: int = 3) -> str:
    """The one number format of the generated tables (``-`` for a missing value)."""
    return "-" if x is None else f"{x:.{digits}f}"


def head_label(row: dict, hand_lookup: dict | None = None) -> str:
    """What a row's drafter head is, in the words of the docs; ``hand_lookup`` (the run's
    ``config.drafter_lookup`` as a dict) marks a drafter whose prompt lookup was set by hand."""
    k = (hand_lookup or {}).get(row.get("name"))
    if k is not None:
        return head_label(row) + f", `--lookup {k}` by hand"
    kind = row.get("kind")
    if kind == "plain":
        return "none (plain decoding)"
    if kind == "lookup":
        return "none (prompt lookup alone)"
    if kind == "trimmed":
        return f"trimmed to {row['draft_vocab_size'] // 1024}k tokens"
    if kind == "lowrank":
        label = f"SlimSpec r = {row['rank']}"
        if row.get("rerank_k"):
            label += f" + rerank {row['rerank_k']}"
        return label
    return f"full ({row.get('draft_vocab_size')} tokens)"


def provenance_lines(d: dict) -> list[str]:
    """Date, machine, versions, prompts and the exact command of one run, as a bullet list."""
    p = d.get("provenance", {})
    versions = ", ".join(f"{k} {v}" for k, v in p.get("versions", {}).items())
    machine = d.get("machine", {})
    load_line = (
        f"; 1-min load average {machine['load_1m']:.2f} on {machine['cpu_count']} cores"
        if machine.get("load_1m") is not None
        else ""
    )
    command = f"- Command: `{p.get('command', '?')}`."
    if p.get("job"):  # the benchmark was one step of a job: the job reproduces the table
        command = f"- Command: `{p['job'].strip()}` (its benchmark step: `{p.get('command', '?')}`)."
    lines = [
        f"- Run: {p.get('date', '?')} on {p.get('machine', '?')}{load_line}; {versions}.",
        f"- Target: {p.get('target', '?')}. Prompts: {p.get('prompts', '?')}.",
        command,
    ]
    if p.get("note"):
        lines.append(f"- Note: {p['note']}.")
    return lines


def e2e_table(d: dict, compact: bool = False) -> list[str]:
    """Markdown rows of a ``bench e2e`` result: speed, acceptance and the paper's cost model.

    ``compact`` keeps the columns a reader of the README needs (the results page has them all).
    """
    if compact:
        lines = [
            "| drafter head | draft shape (auto) | tau | tokens/s | speedup vs plain | lossless |",
            "|---|---|---|---|---|---|",
        ]
    else:
        lines = [
            "| drafter head | draft shape (auto) | tau | tokens/s | speedup vs plain | head ms/round "
            "| round ms | lossless | nu | rho_tau | predicted rho_TPS | measured rho_TPS |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    hand = dict(d["config"].get("drafter_lookup") or [])
    for r in d["rows"]:
        lossless = "-" if r.get("lossless") is None else ("yes" if r["lossless"] else "NO")
        cells = [head_label(r, hand), r.get("shape") or "-", fmt(r["tau"]), fmt(r["tokens_per_s"], 2)]
        cells += [fmt(r["speedup"], 2) + "x"]
        if not compact:
            round_ms = sum(
                r.get(k) or 0.0
                for k in (
                    "target_ms_per_round",
                    "backbone_ms_per_round",
                    "head_ms_per_round",
                    "overhead_ms_per_round",
                )
            )
            cells += [fmt(r.get("head_ms_per_round"), 2), fmt(round_ms, 1)]
        cells.append(lossless)
        if not compact:
            cells += [fmt(r.get(k)) for k in ("nu", "rho_tau", "predicted_rho_tps", "measured_rho_tps")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def e2e_caption(d: dict) -> str:
    """One line saying how the table was measured (greedy, batch, tokens, repeats, kappa)."""
    cfg = d["config"]
    run_on = cfg.get("run_on", {})
    repeats = cfg.get("repeats", 1)
    kappa = d.get("kappa")
    return (
        f"Greedy, batch {cfg['batch_size']}, {d['num_prompts']} prompts, up to {cfg['max_new_tokens']} new "
        f"tokens, {run_on.get('device', cfg['device'])} {run_on.get('dtype', cfg['dtype'])}"
        + (f", fastest of {repeats} interleaved runs per prompt" if repeats > 1 else "")
        + (f", prompt lookup set by hand (`--lookup {cfg['lookup']}`)" if cfg.get("lookup") else "")
        + (
            ", draft shape and prompt lookup planned by `--draft auto` (the default) on held-out prompts"
            if cfg.get("draft_method") == "auto" and cfg.get("lookup") is None
            else ""
        )
        + f". tau = accepted drafts + 1 bonus token per target verification. kappa (full head time over "
        f"everything else in a round) = {fmt(kappa)}." + busy_note(d)
    )


def busy_note(d: dict) -> str:
    """A sentence when the run was timed on a busy machine (the e2e JSON's ``machine.busy``), else ''."""
    m = d.get("machine", {})
    if not m.get("busy"):
        return ""
    if (m.get("reason") or "").startswith("1-min load average") and m["load_1m"] <= m["cpu_count"] + 0.5:
        return (  # the record's rule before the CPU-time reading: a run's own threads made it 'busy'
            f" The run's record flags the machine busy from its 1-min load average ({m['load_1m']:.1f} on"
            f" {m['cpu_count']} cores), which counts the run's own threads; the load stayed within the cores."
        )
    return (
        f" Timed while other jobs loaded the machine (1-min load average {m['load_1m']:.1f} on"
        f" {m['cpu_count']} cores): the rows are comparable with each other, absolute tokens/s are"
        " lower than on a quiet machine."
    )


def results_page() -> str:
    """The whole of ``docs/results.md``."""
    out = [
        "# Results",
        "",
        "Every table on this page is generated by `python scripts/make_docs.py` from the JSON the benchmark",
        "wrote (under `results/`); `tests/unit/test_docs.py` regenerates the page and compares it byte for",
        "byte. Columns: tau = accepted drafts + 1 bonus token per target verification; speedup = tokens/s",
        "over plain decoding in the same run; nu = a head's cost over the full head's; rho_tau = its tau",
        "over the full head's; predicted rho_TPS = rho_tau (1 + kappa) / (1 + nu kappa), the paper's cost",
        "model (docs/method.md), against the measured ratio of tokens/s. Lossless = greedy output identical",
        "to plain decoding on every prompt.",
        "",
    ]
    for rel, title, what in SECTIONS:
        if not (RESULTS / rel).exists():
            continue
        d = load(rel)
        out += [f"## {title}", "", what, ""]
        out += provenance_lines(d) + [""]
        out += [e2e_caption(d), ""]
        out += e2e_table(d) + [""]
    if (RESULTS / GEMMA_JOB).exists():
        d = load(GEMMA_JOB)
        out += [
            f"## {GEMMA_TITLE}",
            "",
            "`bash examples/gemma3_job.sh`: the committed Gemma 3 demo drafter (full head, the target's",
            "tied embedding), its 32k trimmed copy and its SlimSpec conversion (" + job_rank(d) + ",",
            "calibrated, a short recovery fine-tune), with and without the shortlist rerank, plain decoding",
            "and prompt lookup alone, interleaved on held-out evaluation completion prompts of four kinds",
            "(`data/eval/kinds-completion/`, built by `python examples/make_kind_prompts.py --completion`;",
            "nothing was tuned on them); every drafter with the defaults a user gets (`--draft auto`,",
            "planned on held-out training prompts).",
            "",
        ]
        out += provenance_lines(d) + ["", e2e_caption(d), ""]
        out += e2e_table(d) + [""]
        if (RESULTS / "gemma3" / "job_speedup.png").exists():
            out += ["![tokens/s over plain decoding, per drafter](../results/gemma3/job_speedup.png)", ""]
        if d.get("by_kind"):
            out += ["Per kind of prompt, speedup over plain decoding on the same prompts (tau):", ""]
            out += by_kind_table(d) + [""]
    if (RESULTS / GEMMA_CHAIN3).exists():
        d = load(GEMMA_CHAIN3)
        out += [
            "### The cost model at one draft shape",
            "",
            "The same drafters and prompts, every drafter at chain-3 without prompt lookup (the paper's",
            "premise: one shape for all), so the measured tokens/s ratio over the full head can be held",
            "against rho_TPS = rho_tau (1 + kappa) / (1 + nu kappa).",
            "",
        ]
        out += provenance_lines(d) + ["", e2e_caption(d), ""]
        out += cost_model_table(d) + [""]
    if (RESULTS / GEMMA_SWEEP).exists():
        out += sweep_section(load(GEMMA_SWEEP))
    kinds = kind_results()
    if kinds:
        out += [
            "## SmolLM2-135M-Instruct: per kind of prompt, the defaults a user gets",
            "",
            "`bash scripts/bench_kinds.sh`: `slimspec bench e2e` with no draft flags (`--draft auto`:",
            "shape and prompt lookup planned on held-out training prompts), the committed demo drafter",
            "(full head), the same drafter with the main job's former hand-set `--lookup 3`, and its",
            "SlimSpec conversion when given, on held-out evaluation prompts of each kind",
            "(`data/eval/kinds/`, built by `python examples/make_kind_prompts.py`; sources in",
            "`data/README.md`; nothing was tuned on them). Greedy, fastest of the repeats per prompt;",
            "speedup against plain decoding in the same run.",
            "",
        ]
        out += kind_table(kinds) + [""]
        out += [kinds_busy_note(kinds), ""] if kinds_busy_note(kinds) else []
        for kind, d in kinds:
            out += [f"- {kind}: " + provenance_lines(d)[0][2:] + " " + provenance_lines(d)[2][2:]]
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def kinds_busy_note(kinds: list[tuple[str, dict]]) -> str:
    """A sentence when any per-kind run was timed on a busy machine, with the range of its loads, else ''."""
    loads = [d["machine"]["load_1m"] for _, d in kinds if d.get("machine", {}).get("busy")]
    if not loads:
        return ""
    return (
        f"Timed while other jobs loaded the machine (1-min load average {min(loads):.1f}-{max(loads):.1f} on"
        f" {kinds[0][1]['machine']['cpu_count']} cores): rows of one kind ran interleaved and compare with"
        " each other; absolute tokens/s are lower than on a quiet machine, and `--draft auto` re-planned for"
        " each kind (a plan made on a busy machine is not reused), so its shape varies with the noise."
    )


def kind_results() -> list[tuple[str, dict]]:
    """Per-kind ``bench e2e`` results under ``results/smollm2/kinds/``, in a fixed order."""
    folder = RESULTS / "smollm2" / "kinds"
    if not folder.is_dir():
        return []
    found = {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in sorted(folder.glob("*.json"))}
    order = [k for k in KIND_ORDER if k in found] + sorted(k for k in found if k not in KIND_ORDER)
    return [(k, found[k]) for k in order]


def kind_table(kinds: list[tuple[str, dict]]) -> list[str]:
    """One row per kind of prompt and drafter: tau, speedup over plain and the shape auto chose."""
    lines = [
        "| kind of prompt | prompts | drafter head | draft shape (auto) | tau | tokens/s | speedup vs plain "
        "| lossless |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, d in kinds:
        hand = dict(d["config"].get("drafter_lookup") or [])
        for r in d["rows"]:
            if r.get("kind") == "plain":
                continue
            lossless = "-" if r.get("lossless") is None else ("yes" if r["lossless"] else "NO")
            lines.append(
                f"| {kind} | {d['num_prompts']} | {head_label(r, hand)} | {r.get('shape') or '-'} "
                f"| {fmt(r['tau'])} | {fmt(r['tokens_per_s'], 2)} | {fmt(r['speedup'], 2)}x | {lossless} |"
            )
    return lines


def vs_reference(d: dict) -> dict[str, float]:
    """Each row's tokens/s over the reference (full-head) drafter's, by row name; {} without one."""
    ref = next((r for r in d["rows"] if r["name"] == d.get("reference")), None)
    if ref is None:
        return {}
    return {r["name"]: r["tokens_per_s"] / ref["tokens_per_s"] for r in d["rows"]}


def job_table(d: dict) -> list[str]:
    """The large-vocabulary job's rows: shape, tau, tokens/s, speedup over plain and over the full head."""
    lines = [
        "| drafter head | draft shape (auto) | tau | tokens/s | vs plain | vs full head | lossless |",
        "|---|---|---|---|---|---|---|",
    ]
    over_full = vs_reference(d)
    for r in d["rows"]:
        lossless = "-" if r.get("lossless") is None else ("yes" if r["lossless"] else "NO")
        lines.append(
            f"| {head_label(r)} | {r.get('shape') or '-'} | {fmt(r['tau'])} | {fmt(r['tokens_per_s'], 2)} "
            f"| {fmt(r['speedup'], 2)}x | {fmt(over_full.get(r['name']), 2)}x | {lossless} |"
        )
    return lines


def by_kind_table(d: dict) -> list[str]:
    """Speedup over plain decoding per kind of prompt (the e2e JSON's ``by_kind``), one column per drafter."""
    kinds = d.get("by_kind") or {}
    if not kinds:
        return []
    labels = {r["name"]: head_label(r) for r in d["rows"]}
    names = [r["name"] for r in next(iter(kinds.values()))][1:]  # plain decoding is the 1.00x column
    lines = [
        "| kind of prompt | prompts | plain tokens/s | " + " | ".join(labels[n] for n in names) + " |",
        "|---|---|---|" + "---|" * len(names),
    ]
    for kind, rows in kinds.items():
        by = {r["name"]: r for r in rows}
        cells = [
            f"{fmt(by[n]['speedup'], 2)}x"
            + (f" (tau {fmt(by[n]['tau'], 2)})" if by[n].get("tau") is not None else "")
            + ("" if by[n].get("lossless") is not False else " NOT lossless")
            for n in names
        ]
        lines.append(
            f"| {kind} | {rows[0]['prompts']} | {fmt(rows[0]['tokens_per_s'], 2)} | "
            + " | ".join(cells)
            + " |"
        )
    return lines


def cost_model_table(d: dict) -> list[str]:
    """Predicted against measured rho_TPS (over the full head, one draft shape for every drafter)."""
    lines = [
        "| drafter head | shape | tau | head ms/round | nu | rho_tau | predicted rho_TPS | measured rho_TPS "
        "| error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in d["rows"]:
        if r.get("kind") in ("plain", "lookup"):
            continue
        pred, meas = r.get("predicted_rho_tps"), r.get("measured_rho_tps")
        err = "-" if pred is None or meas is None else f"{100 * (pred / meas - 1):+.1f}%"
        lines.append(
            f"| {head_label(r)} | {r.get('shape') or '-'} | {fmt(r['tau'])} "
            f"| {fmt(r.get('head_ms_per_round'), 2)} | {fmt(r.get('nu'))} | {fmt(r.get('rho_tau'))} "
            f"| {fmt(pred)} | {fmt(meas)} | {err} |"
        )
    return lines


def job_rank(d: dict) -> str:
    """How the job chose the low-rank drafter's r, from its rows and the sweep's JSON."""
    r = next(r["rank"] for r in d["rows"] if r.get("kind") == "lowrank")
    if (RESULTS / GEMMA_SWEEP).exists() and load(GEMMA_SWEEP).get("recommended_rank") == r:
        return f"r = {r}, the rank sweep's pick"
    return f"r = {r}"


def sweep_section(s: dict) -> list[str]:
    """The job's rank sweep: each rank's greedy acceptance, head latency and predicted rho_TPS."""
    best = "the full head" if s["recommended_rank"] is None else f"r = {s['recommended_rank']}"
    how = [
        "calibrated factors" if s.get("calibrated") else "plain truncated SVD",
        f"the shortlist rerank of the top {s['rerank']}" if s.get("rerank") else "no rerank",
        "top-1 agreement" if s.get("acceptance") == "greedy" else "expected acceptance",
    ]
    lines = [
        "### Choosing r: the rank sweep",
        "",
        f"`slimspec rank-sweep` in the job (held-out continuations `data/heldout/gemma3/`, never trained on;"
        f" {how[0]}, {how[1]}; acceptance = {how[2]} of the first draft over {s['num_positions']:,}"
        f" positions; tau from a chain of {s['num_draft_tokens']}; head latency at batch 1 and kappa ="
        f" {fmt(s['kappa'])} measured in the same run). It picks {best}"
        f" (predicted rho_TPS {fmt(s['recommended_speedup'])}; ceiling 1 + kappa = {fmt(s['ceiling'])}).",
        "",
        "| rank | top-1 | exp. acceptance | tau est. | head ms | nu | rho_tau | predicted rho_TPS |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in s["rows"]:
        lines.append(
            f"| {'full' if r['rank'] is None else r['rank']} | {fmt(r['top1_agreement'])} "
            f"| {fmt(r['expected_acceptance'])} | {fmt(r['tau_estimate'])} | {fmt(r['head_ms'], 2)} "
            f"| {fmt(r['nu'])} | {fmt(r['rho_tau'])} | {fmt(r['predicted_speedup'])} |"
        )
    return lines + [""]


def gemma_caption(d: dict) -> str:
    """Where and how the large-vocabulary job was measured, in one paragraph."""
    p = d["provenance"]
    kinds = d.get("by_kind") or {}
    per = {rows[0]["prompts"] for rows in kinds.values()}
    planned = p["prompts"].split(" planned on ")[-1]
    prompts = (
        f"the first {per.pop()} prompts of each of `data/eval/kinds-completion/{{{','.join(kinds)}}}.jsonl`"
        f" (held-out evaluation prompts), interleaved; draft shapes planned on {planned}"
        if len(per) == 1 and " planned on " in p["prompts"]
        else p["prompts"]
    )
    return (
        f"Gemma 3 270M target (base model, V = 262,144, completion prompts), {p['machine']}, {p['date']}, "
        f"`{(p.get('job') or p['command']).strip()}`; {prompts}. " + e2e_caption(d)
    )


def chain3_line() -> str:
    """One sentence on the job's one-shape run: SlimSpec over the full head, the cost model's worst error."""
    c = load(GEMMA_CHAIN3)
    rows = [r for r in c["rows"] if r.get("predicted_rho_tps") is not None and r["name"] != c["reference"]]
    worst = max(abs(r["predicted_rho_tps"] / r["measured_rho_tps"] - 1) for r in rows)
    parts = "; ".join(f"{head_label(r)} {fmt(r['measured_rho_tps'], 2)}x" for r in rows)
    return (
        f"At one shape for all (chain-3, no prompt lookup; kappa = {fmt(c['kappa'])}), tokens/s over the full"
        f" head: {parts}; the cost model rho_TPS = rho_tau (1 + kappa) / (1 + nu kappa) is within"
        f" {100 * worst:.1f}% of each ([docs/results.md](docs/results.md))."
    )


def headline_block() -> str:
    """The README's one results table: the large-vocabulary job where it has run (else SmolLM2's main
    job), compact, with where it was measured."""
    if (RESULTS / GEMMA_JOB).exists():
        d = load(GEMMA_JOB)
        lines = [gemma_caption(d), "", *job_table(d)]
        if d.get("by_kind"):
            lines += ["", "Per kind of prompt, speedup over plain decoding (tau):", "", *by_kind_table(d)]
        if (RESULTS / GEMMA_CHAIN3).exists():
            lines += ["", chain3_line()]
        return "\n".join(lines)
    d = load("smollm2/mainjob.json")
    p = d["provenance"]
    return "\n".join(
        [
            f"SmolLM2-135M-Instruct target (V = 49,152), {p['machine']}, {p['date']}, "
            f"`{p.get('job') or p['command']}`; {p['prompts']}.",
            e2e_caption(d),
            "",
            *e2e_table(d, compact=True),
        ]
    )


def card_eval_block() -> str:
    """The demo drafter's evaluation table (its model card): the full head per kind of prompt."""
    kinds = kind_results()
    if not kinds:
        d = load("smollm2/mainjob.json")
        rows = [r for r in d["rows"] if r.get("name") == "full"]
        return "\n".join([e2e_caption(d), "", *e2e_table({**d, "rows": rows}, compact=True)])
    full = [(k, {**d, "rows": [r for r in d["rows"] if r.get("kind") == "full"]}) for k, d in kinds]
    cfg = kinds[0][1]["config"]
    run_on = cfg.get("run_on", {})
    caption = (
        f"Greedy, batch {cfg['batch_size']}, held-out prompts of each kind (`data/eval/kinds/`), up to"
        f" {cfg['max_new_tokens']} new tokens, {run_on.get('device', cfg['device'])}"
        f" {run_on.get('dtype', cfg['dtype'])}, speedup against plain"
        " decoding in the same run; the settings and commands are on the results page."
    )
    note = kinds_busy_note(kinds)
    return "\n".join([caption + (" " + note if note else ""), "", *kind_table(full)])


def gemma_card_eval_block() -> str:
    """The Gemma 3 drafter's evaluation (its model card): the full head in the job's two runs."""
    d = load(GEMMA_JOB)
    lines = [gemma_caption(d), ""]
    lines += job_table({**d, "rows": [r for r in d["rows"] if r.get("kind") in ("plain", "full")]})
    if d.get("by_kind"):
        full = {
            **d,
            "by_kind": {
                k: [r for r in rows if r["name"] in ("none", d["reference"])]
                for k, rows in d["by_kind"].items()
            },
        }
        lines += ["", "Per kind of prompt, speedup over plain decoding (tau):", "", *by_kind_table(full)]
    if (RESULTS / GEMMA_CHAIN3).exists():
        c = load(GEMMA_CHAIN3)
        r = next(r for r in c["rows"] if r["name"] == c["reference"])
        lines += [
            "",
            "At chain-3 without prompt lookup (the job's cost-model run, same prompts): "
            f"tau {fmt(r['tau'])}, "
            f"{fmt(r['tokens_per_s'], 2)} tokens/s, {fmt(r['speedup'], 2)}x plain decoding, "
            + ("lossless." if r.get("lossless") else "NOT lossless."),
        ]
    return "\n".join(lines)


def training_run_lines(rel: str, what: str) -> list[str]:
    """One training run of the Gemma 3 drafter (``examples/training_record.py``'s JSON): the command
    and the run's figures."""
    t = load(rel)
    return [
        f"{what} ({t['date']}, {t['machine']}; figures from `results/{rel}`):",
        "```bash",
        t["command"],
        "```",
        f"{t['steps_run']} optimizer steps of {t['batch_size']} records of {t['records']:,} "
        f"({t['train_tokens']:,} supervised completion tokens seen, {t['epochs']:.1f} epochs), "
        f"{fmt(t['tokens_per_s'], 0)} tokens/s of training on {t['threads']} threads "
        f"({t['tokens_per_s_note']});"
        f" held-out selection score ({t['score_kind']}, chain of {t['metric_depth']}) "
        f"{fmt(t['score_before'])} before the run, {fmt(t['score_kept'])} at the kept step "
        f"{t['kept_step']}.",
        *([t["then"]] if t.get("then") else []),  # what was done with the kept checkpoint
    ]


def gemma_card_recipe_block() -> str:
    """The Gemma 3 drafter's training runs (its model card): each command and its figures."""
    more = [rel for rel in GEMMA_CONTINUATIONS if (RESULTS / rel).exists()]
    lines = training_run_lines(GEMMA_TRAINING, "The first run" if more else "The run")
    for rel in more:
        lines += ["", *training_run_lines(rel, "Then, from the previous run's kept checkpoint")]
    return "\n".join(lines)


def vllm_bench_block() -> str:
    """docs/serving.md: the `slimspec bench vllm` table, with where and how it was measured."""
    sys.path.insert(0, str(ROOT))
    from slimspec_convert.engines.vllm.bench import table  # no vLLM import: formatting only

    d = load("vllm/bench_vllm.json")
    m = d["machine"]
    return "\n".join(
        [
            f"Measured {m['date']} on {m['processor']} ({m['cpu_count']} cores; 1-min load average "
            f"{m['load_1m_start']:.2f} at the start, {m['load_1m_end']:.2f} at the end), torch {m['torch']}, "
            f"vLLM {m['vllm']}, from `results/vllm/bench_vllm.json`:",
            "",
            f"`{m['command']}`",
            "",
            table(d).rstrip("\n"),
        ]
    )


BLOCKS: dict[Path, dict[str, Callable[[], str]]] = {
    ROOT / "README.md": {"headline": headline_block},
    ROOT / "docs" / "serving.md": {"vllm-bench": vllm_bench_block},
    ROOT / "drafters" / "smollm2-135m-eagle3" / "README.md": {"eval": card_eval_block},
}
if (RESULTS / GEMMA_JOB).exists() and (RESULTS / GEMMA_TRAINING).exists():
    BLOCKS[GEMMA_CARD] = {"eval": gemma_card_eval_block, "recipe": gemma_card_recipe_block}
PAGES: dict[Path, Callable[[], str]] = {ROOT / "docs" / "results.md": results_page}


def fill_blocks(text: str, blocks: dict[str, Callable[[], str]], path: Path) -> str:
    """``text`` with each named generated block replaced by its fresh content.

    Raises:
        ValueError: if a block's markers are missing from ``path``.
    """
    for name, make in blocks.items():
        pattern = re.compile(
            rf"(<!-- BEGIN generated: {name} -->\n).*?(<!-- END generated: {name} -->)", re.DOTALL
        )
        if not pattern.search(text):
            raise ValueError(f"{path}: no '<!-- BEGIN generated: {name} -->' ... END block to fill")
        text = pattern.sub(lambda m, make=make: m.group(1) + make() + "\n" + m.group(2), text)
    return text


def expected_files() -> dict[Path, str]:
    """Every generated file's expected content."""
    out = {path: make() for path, make in PAGES.items()}
    for path, blocks in BLOCKS.items():
        out[path] = fill_blocks(path.read_text(encoding="utf-8"), blocks, path)
    return out


def cost_model_plot(path: Path) -> Path:
    """``docs/img/cost_model.png``: predicted rho_TPS against kappa (paper section 3), measured kappa marked.

    Curves for a head at ``nu = 1/8`` (SlimSpec at r = d/8 on a large vocabulary) keeping all, 97% and 93%
    of the full head's tau, and the ceiling ``1 + kappa``; vertical lines at the kappa of each committed
    main-job result and at the paper's Llama-3.1-8B figure (about 0.25, GPU, batch 1).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kappas = [i / 100 for i in range(0, 151)]
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=110)
    ax.plot(kappas, [1 + k for k in kappas], color="grey", linestyle=":", label="ceiling 1 + kappa")
    for rho_tau in (1.0, 0.97, 0.93):
        ax.plot(
            kappas, [rho_tau * (1 + k) / (1 + k / 8) for k in kappas], label=f"nu = 1/8, rho_tau = {rho_tau}"
        )
    marks = [("Llama-3.1-8B, GPU (paper)", 0.25)]
    for rel, title, _ in SECTIONS:
        if (RESULTS / rel).exists() and load(rel).get("kappa") is not None:
            marks.append((title.split(":")[0].split("-")[0] + ", 2 CPU cores", load(rel)["kappa"]))
    for label, k in marks:
        ax.axvline(k, color="black", linewidth=0.8)
        ax.text(k + 0.012, 2.5, label, rotation=90, fontsize=7, va="top")
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.set_xlabel("kappa = full head time / everything else in a round")
    ax.set_ylabel("predicted rho_TPS")
    ax.set_title("speedup over the full head: rho_tau (1 + kappa) / (1 + nu kappa)", fontsize=9)
    ax.set_ylim(0.85, 2.55)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    """Rewrite (or with ``--check`` compare) the generated pages; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 on any difference")
    parser.add_argument("--plots", action="store_true", help="also redraw docs/img/cost_model.png")
    args = parser.parse_args(argv)
    if args.plots and not args.check:
        cost_model_plot(ROOT / "docs" / "img" / "cost_model.png")
    stale = []
    for path, want in expected_files().items():
        have = path.read_text(encoding="utf-8") if path.exists() else ""
        if have == want:
            continue
        stale.append(path)
        if args.check:
            rel = str(path.relative_to(ROOT))
            sys.stdout.writelines(
                difflib.unified_diff(have.splitlines(True), want.splitlines(True), rel, rel)
            )
        else:
            path.write_text(want, encoding="utf-8")
    if args.check and stale:
        print(f"stale: {', '.join(str(p.relative_to(ROOT)) for p in stale)}; run python scripts/make_docs.py")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
