"""Readable tables of results (markdown) and the one number format they share."""

from __future__ import annotations

from slimspec_convert.measure.e2e import E2EResult
from slimspec_convert.measure.linear_product import LinearProductChoice


def fmt_number(x: float | None, digits: int = 3) -> str:
    """``x`` with ``digits`` decimals, or ``-`` for None (the one number format of every results table)."""
    return "-" if x is None else f"{x:.{digits}f}"


def e2e_markdown(result: E2EResult) -> str:
    """Markdown table of the run and the cost-model comparison."""
    cfg = result.config
    lines = [
        f"End-to-end, greedy, {result.num_prompts} prompts, {cfg['max_new_tokens']} new tokens max, batch "
        f"{cfg['batch_size']}, draft {cfg['draft_method']}"
        + (f", {cfg['run_on']['device']} {cfg['run_on']['dtype']}" if cfg.get("run_on") else "")
        + (f", fastest of {cfg['repeats']} interleaved runs per prompt" if cfg.get("repeats", 1) > 1 else "")
        + ". tau = accepted drafts + 1 bonus per verification.",
        "",
        "| drafter | head | shape | tau | tokens/s | speedup vs plain | target ms/round | body ms/round "
        "| head ms/round | other ms/round | lossless | nu | rho_tau | predicted rho_TPS | measured rho_TPS "
        "| auto: predicted tau | auto: predicted tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result.rows:
        head = (
            r.kind
            + (f" r={r.rank}" if r.rank else "")
            + (f" +rerank k={r.rerank_k}" if r.rerank_k else "")
            + (f" ctx={r.rerank_context}" if r.rerank_k and r.rerank_context else "")
            + (f" V_d={r.draft_vocab_size}" if r.draft_vocab_size else "")
        )
        lossless = (
            "-" if r.lossless is None else ("yes" if r.lossless else f"NO ({r.num_mismatched_prompts})")
        )
        lines.append(
            f"| {r.name} | {head} | {r.shape or '-'} | {fmt_number(r.tau)} | {r.tokens_per_s:.2f} "
            f"| {r.speedup:.3f} "
            f"| {fmt_number(r.target_ms_per_round, 2)} | {fmt_number(r.backbone_ms_per_round, 2)} "
            f"| {fmt_number(r.head_ms_per_round, 2)} | {fmt_number(r.overhead_ms_per_round, 2)} | {lossless} "
            f"| {fmt_number(r.nu)} | {fmt_number(r.rho_tau)} | {fmt_number(r.predicted_rho_tps)} "
            f"| {fmt_number(r.measured_rho_tps)} | {fmt_number(r.predicted_tau)} "
            f"| {fmt_number(r.predicted_tokens_per_s, 2)} |"
        )
    if result.reference is None:
        lines += ["", "No full-head drafter in the run: kappa, nu and rho_tau are not defined."]
    else:
        lines += [
            "",
            f"Reference (full head): {result.reference}; kappa = {result.kappa:.4f} "
            f"(head ms / all other ms, whole run); ceiling 1 + kappa = {1 + result.kappa:.4f}.",
        ]
    if result.by_kind:
        lines += ["", "Per kind of prompt (tokens/s, speedup vs plain on the same prompts, tau):", ""]
        for kind, rows in result.by_kind.items():
            cells = "; ".join(
                f"{r['name']} {r['tokens_per_s']:.2f} ({r['speedup']:.2f}x"
                + (f", tau {r['tau']:.2f}" if r["tau"] is not None else "")
                + (", NOT lossless" if r["lossless"] is False else "")
                + ")"
                for r in rows
            )
            lines.append(f"- {kind} ({rows[0]['prompts']} prompts): {cells}")
        lines.append("")
    m = result.machine
    if m is not None:
        lines.append(
            f"Machine: 1-min load average {fmt_number(m.load_1m, 2)} on {m.cpu_count} cores"
            + (f"; BUSY ({m.reason}): timings are noisy." if m.busy else ".")
        )
    if result.linear_product is not None:
        lines.append(
            f"Target and drafters, {LinearProductChoice.from_dict(result.linear_product).summary()}."
        )
    return "\n".join(lines) + "\n"
