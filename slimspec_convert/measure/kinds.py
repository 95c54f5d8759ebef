"""Each kind of prompt apart: a `bench e2e` run's per-prompt results summed per kind (code, math, ...)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def by_kind(per_prompt: Mapping[str, list[dict]], kinds: Sequence[str | None]) -> dict[str, list[dict]]:
    """Each kind of prompt apart: per configuration, tau, tokens/s and speedup over plain decoding
    on that kind's prompts alone, and whether its outputs equal plain decoding's.

    Args:
        per_prompt: :attr:`E2EResult.per_prompt` (configuration -> per-prompt ``output_ids`` and
            :class:`~slimspec_convert.decoding.results.GenerationStats` fields; plain decoding first).
        kinds: one kind per prompt, in prompt order (None: the prompt belongs to no kind, ``"-"``).

    Returns:
        kind (in order of first appearance) -> one dict per configuration: ``name``, ``prompts``,
        ``new_tokens``, ``wall_ms`` (sums of the prompts' kept runs, ms), ``tokens_per_s``,
        ``speedup`` (over plain decoding on the same prompts), ``tau`` (committed tokens per
        verification round; None without a round), ``lossless`` (None for plain decoding).

    Raises:
        ValueError: ``kinds`` and the prompts differ in number.
    """
    names = list(per_prompt)
    plain = per_prompt[names[0]]
    if len(kinds) != len(plain):
        raise ValueError(f"by_kind: {len(kinds)} kinds for {len(plain)} prompts")
    order = list(dict.fromkeys(k or "-" for k in kinds))
    out: dict[str, list[dict]] = {}
    for kind in order:
        idx = [i for i, k in enumerate(kinds) if (k or "-") == kind]
        rows = []
        for name in names:
            stats = [per_prompt[name][i] for i in idx]
            new, wall = sum(s["new_tokens"] for s in stats), sum(s["wall_ms"] for s in stats)
            committed = sum(sum(s["committed_per_cycle"]) for s in stats)
            cycles = sum(s["cycles"] for s in stats)
            same = all(per_prompt[name][i]["output_ids"] == plain[i]["output_ids"] for i in idx)
            rows.append(
                dict(
                    name=name,
                    prompts=len(idx),
                    new_tokens=new,
                    wall_ms=wall,
                    tokens_per_s=new / (wall / 1e3) if wall > 0 else 0.0,
                    tau=committed / cycles if cycles else None,
                    lossless=None if name == names[0] else same,
                )
            )
        base = rows[0]["tokens_per_s"]
        for r in rows:
            r["speedup"] = r["tokens_per_s"] / base if base > 0 else None
        out[kind] = rows
    return out
