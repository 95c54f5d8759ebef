"""Spread of several main-job runs: per drafter, tau and the min / median / max of tokens/s, speedup
over plain decoding, measured and predicted rho_TPS, and which rankings hold in every run.

Usage: python examples/main_job_spread.py RUN_DIR/e2e/e2e.json ... > spread.md
"""

import itertools
import json
import statistics
import sys

runs = [json.load(open(p)) for p in sys.argv[1:]]
names = [r["name"] for r in runs[0]["rows"]]


def values(name: str, key: str) -> list[float]:
    return [next(r[key] for r in run["rows"] if r["name"] == name) for run in runs]


def spread(xs: list) -> str:
    if any(x is None for x in xs):
        return "-"
    return f"{min(xs):.3f} / {statistics.median(xs):.3f} / {max(xs):.3f}"


loads = [run["machine"]["load_1m"] for run in runs]
print(f"{len(runs)} runs; load average (1 min) at the end of each: {loads}")
print()
HEADER = ("drafter", "tau", "tokens/s (min / median / max)", "speedup vs plain", "measured rho_TPS")
print("| " + " | ".join(HEADER + ("predicted rho_TPS",)) + " |")
print("|---|---|---|---|---|---|")
for n in names:
    taus = sorted(set(round(t, 3) for t in values(n, "tau")))
    cells = [
        spread(values(n, k)) for k in ("tokens_per_s", "speedup", "measured_rho_tps", "predicted_rho_tps")
    ]
    print(f"| {n} | {', '.join(map(str, taus))} | " + " | ".join(cells) + " |")
print()
print("Rankings by tokens/s that hold in every run:")
for a, b in itertools.permutations(names, 2):
    if all(x > y for x, y in zip(values(a, "tokens_per_s"), values(b, "tokens_per_s"), strict=True)):
        print(f"- {a} > {b}")
errors = [
    abs(p / m - 1)
    for n in names
    for p, m in zip(values(n, "predicted_rho_tps"), values(n, "measured_rho_tps"), strict=True)
    if p is not None and m is not None and n != runs[0]["reference"]
]
if errors:
    print(f"\nCost model: predicted / measured rho_TPS within {100 * max(errors):.1f}% in every run and row")
