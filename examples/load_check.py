"""Issue 53's load check: the main job's convert step, once on a quiet machine and once beside two
CPU-bound processes, with the wall time and the moments its progress moved.

Acceptance: beside two CPU-bound processes on 2 cores the convert finishes within 3x its quiet time,
its progress moving at least once a minute. The convert is examples/quickstart.sh's step 2,
``slimspec convert DRAFTER OUT --target TARGET --force`` (calibrated on the target's answers to 64
built-in training prompts), with the default ``--threads`` (the command picks what the machine can
give). Progress moments are read from the command's stderr as it runs: each change of a tqdm
counter (``distill``, ``calibrate``) or a new log line counts as a move.

Run it on a machine nobody else uses (``uptime`` load below ~1; it refuses to start above
``--max-load`` unless ``--force``). Expect about 2 x 105 s quiet plus up to 3 x 105 s busy,
roughly 7-10 minutes on 2 cores.

Usage: python examples/load_check.py [--out runs/load_check.json] [--drafter D] [--target T]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BAR = re.compile(r"^\s*([\w -]+?):\s+\d+%\|.*?\|\s*(\d+)/(\d+)")
SPIN = "while True: pass"


def progress_run(cmd: list[str], env: dict) -> dict:
    """Run ``cmd``; return its wall time, exit code and the times (s from start) its progress moved."""
    load_before = os.getloadavg()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    moves: list[tuple[float, str]] = []
    last: dict[str, str] = {}
    tail: list[str] = []

    def read_stderr() -> None:
        buf = b""
        while chunk := proc.stderr.read1(4096):
            buf += chunk
            *parts, buf = re.split(rb"[\r\n]", buf)
            for raw in parts:
                line = raw.decode(errors="replace").strip()
                if not line:
                    continue
                tail.append(line)
                m = BAR.match(line)
                key, value = (m.group(1), m.group(2)) if m else ("log", line)
                if last.get(key) != value:
                    last[key] = value
                    moves.append((round(time.monotonic() - t0, 2), f"{key} {value}" if m else line[:80]))

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    stdout = proc.stdout.read().decode(errors="replace")
    proc.wait()
    reader.join()
    wall = time.monotonic() - t0
    times = [0.0] + [t for t, _ in moves] + [wall]
    return {
        "wall_s": round(wall, 2),
        "returncode": proc.returncode,
        "moves": moves,
        "max_gap_s": round(max(b - a for a, b in zip(times, times[1:], strict=False)), 2),
        "threads_line": next((x for x in tail if x.startswith("threads:")), None),
        "stdout_tail": stdout.strip().splitlines()[-3:],
        "stderr_tail": tail[-3:],
        "load_before": load_before,
        "load_after": os.getloadavg(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/load_check.json")
    ap.add_argument("--drafter", default=str(REPO / "drafters" / "smollm2-135m-eagle3"))
    ap.add_argument("--target", default=None, help="default: slimspec fetch-smollm2")
    ap.add_argument("--spinners", type=int, default=2, help="CPU-bound processes beside the busy run")
    ap.add_argument("--max-load", type=float, default=1.0)
    ap.add_argument("--force", action="store_true", help="run although the machine is not quiet")
    args = ap.parse_args()
    slimspec = shutil.which("slimspec") or sys.exit("slimspec not on PATH: source scripts/setup.sh")
    load = os.getloadavg()[0]
    if load > args.max_load and not args.force:
        sys.exit(
            f"1-min load average {load:.2f} > {args.max_load}: the quiet run would not be quiet (--force)"
        )
    target = args.target or subprocess.check_output([slimspec, "fetch-smollm2"], text=True).strip()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the command's own default
    result = {"command": None, "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()}}
    with tempfile.TemporaryDirectory(prefix="slimspec-load-check-") as tmp:
        cmd = [slimspec, "convert", args.drafter, f"{tmp}/slimspec-r72", "--target", target, "--force"]
        result["command"] = " ".join(cmd)
        print(f"quiet run (load {load:.2f}) ...", flush=True)
        result["quiet"] = progress_run(cmd, env)
        spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.spinners)]
        try:
            time.sleep(5)  # let them take their cores
            print(f"busy run beside {args.spinners} CPU-bound processes ...", flush=True)
            result["busy"] = progress_run(cmd, env)
        finally:
            for p in spinners:
                p.kill()
                p.wait()
    q, b = result["quiet"], result["busy"]
    result["ratio"] = round(b["wall_s"] / q["wall_s"], 3)
    result["pass"] = {
        "both_succeeded": q["returncode"] == 0 and b["returncode"] == 0,
        "busy_within_3x_quiet": result["ratio"] <= 3.0,
        "busy_progress_every_60s": b["max_gap_s"] <= 60.0,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"quiet {q['wall_s']:.0f} s, busy {b['wall_s']:.0f} s ({result['ratio']:.2f}x), longest busy gap "
        f"{b['max_gap_s']:.0f} s; {result['pass']}; wrote {out}"
    )


if __name__ == "__main__":
    main()
