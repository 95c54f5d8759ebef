"""Is the machine quiet enough to trust a timing? The 1-min load average against the core count, and
the spread of repeated timings, recorded beside every benchmark result.

A benchmark on a shared machine still runs, but its result says so: ``machine.busy`` is True with the
reason (load above the number of cores: runnable processes are queuing for a core; or repeated
timings of one callable spread by more than :data:`DEFAULT_MAX_TIMING_SPREAD` of their median).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

# Interquartile range over median of repeated timings above which a run counts as noisy. A quiet
# CPU or GPU keeps it to a few percent for the head matmuls; a second job on the cores makes it tens.
DEFAULT_MAX_TIMING_SPREAD = 0.15


@dataclass(frozen=True)
class MachineState:
    """The machine during a benchmark.

    Attributes:
        load_1m: 1-min load average (``os.getloadavg``), None where the OS has none.
        cpu_count: cores the OS reports (``os.cpu_count``).
        timing_spread: largest (q75 - q25) / median over the timed callables, None when not measured.
        busy: load_1m > cpu_count, or timing_spread > the threshold.
        reason: why it is busy (None when it is not).
    """

    load_1m: float | None
    cpu_count: int
    timing_spread: float | None
    busy: bool
    reason: str | None

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return asdict(self)


def timing_spread(samples_ms: Sequence[float]) -> float:
    """Interquartile range over median of repeated timings (0 for fewer than two samples).

    Quartiles are ``statistics.quantiles(..., n=4, method="inclusive")`` (linear interpolation
    between order statistics, as numpy's default): for [10, 11, 12, 14] they are 10.75 and 12.5, the
    median 11.5, the spread 1.75 / 11.5.

    Args:
        samples_ms: one callable's timed rounds, ms.

    Returns:
        A non-negative float.
    """
    if len(samples_ms) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(samples_ms, n=4, method="inclusive")
    median = statistics.median(samples_ms)
    return (q3 - q1) / median if median > 0 else 0.0


def assess_machine(
    load_1m: float | None,
    cpu_count: int,
    spread: float | None = None,
    max_spread: float = DEFAULT_MAX_TIMING_SPREAD,
) -> MachineState:
    """Decide whether a measurement ran on a busy machine (pure: the readings are arguments).

    Args:
        load_1m: 1-min load average, or None when unknown.
        cpu_count: cores.
        spread: :func:`timing_spread` of the run, or None when not measured.
        max_spread: the spread above which timings count as noisy.

    Returns:
        :class:`MachineState`.
    """
    reasons = []
    if load_1m is not None and load_1m > cpu_count:
        reasons.append(f"1-min load average {load_1m:.2f} > {cpu_count} cores")
    if spread is not None and spread > max_spread:
        reasons.append(f"timing spread (IQR / median) {spread:.2f} > {max_spread:.2f}")
    return MachineState(load_1m, cpu_count, spread, bool(reasons), "; ".join(reasons) or None)


def read_runnable_others(samples: int = 5, interval_s: float = 0.02) -> int | None:
    """Processes runnable right now besides this one (``/proc/loadavg``'s 4th field), the median of a
    few readings; None where there is no ``/proc/loadavg``.

    The 1-min load average lags: two jobs started 10 s ago add only ~0.3 to it. The runnable count
    sees them at once (it includes the reading process itself, hence the minus one).
    """
    counts = []
    for i in range(samples):
        try:
            with open("/proc/loadavg", encoding="ascii") as f:
                counts.append(int(f.read().split()[3].split("/")[0]) - 1)
        except (OSError, IndexError, ValueError):
            return None
        if i + 1 < samples:
            time.sleep(interval_s)
    return max(0, int(statistics.median(counts)))


def other_cpu_load(
    busy_ticks: tuple[int, int], own_ticks: tuple[int, int], elapsed_s: float, ticks_per_s: float
) -> float:
    """Cores the *other* processes kept busy over a window (pure: the readings are arguments).

    Args:
        busy_ticks: the machine's busy CPU time (``/proc/stat``: user, nice, system, irq, softirq,
            steal; all cores summed) at the start and end of the window, in clock ticks.
        own_ticks: this process's CPU time (``/proc/self/stat``: utime + stime) at the same two
            moments, in clock ticks.
        elapsed_s: the window's wall-clock length, seconds (> 0).
        ticks_per_s: clock ticks per second (``os.sysconf("SC_CLK_TCK")``, usually 100).

    Returns:
        ``max(0, (busy - own) / (elapsed_s * ticks_per_s))``: 0.0 on an idle machine, 2.0 with two
        other processes each spinning on a core, whatever this process did in the window.
    """
    busy = (busy_ticks[1] - busy_ticks[0]) - (own_ticks[1] - own_ticks[0])
    return max(0.0, busy / (elapsed_s * ticks_per_s))


def _proc_ticks() -> tuple[int, int]:
    """(machine busy ticks, this process's ticks) from ``/proc/stat`` and ``/proc/self/stat``."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = sum(fields[i] for i in (0, 1, 2, 5, 6, 7) if i < len(fields))  # user nice system irq softirq steal
    with open("/proc/self/stat", encoding="ascii") as f:
        own = f.read().rsplit(")", 1)[1].split()  # fields after the command name; utime, stime = 14, 15
    return busy, int(own[11]) + int(own[12])


def read_other_load(window_s: float = 0.3) -> float | None:
    """The cores other processes keep busy now: :func:`other_cpu_load` over a ``window_s`` window.

    Unlike the 1-min load average, it neither lags (two jobs started 10 s ago count in full) nor
    remembers work that has ended (a benchmark's own previous step, or the previous command of a
    script, leaves the average near the cores for a minute after it stopped). None where there is
    no ``/proc/stat`` (then callers fall back to :func:`read_load_1m`).
    """
    try:
        busy0, own0 = _proc_ticks()
        t0 = time.perf_counter()
        time.sleep(window_s)
        busy1, own1 = _proc_ticks()
        elapsed = time.perf_counter() - t0
        return other_cpu_load((busy0, busy1), (own0, own1), elapsed, float(os.sysconf("SC_CLK_TCK")))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def read_competing_load() -> float | None:
    """The load other work puts on the cores now: :func:`read_other_load`, else the 1-min load
    average where ``/proc/stat`` is unavailable (None when neither is)."""
    other = read_other_load()
    return other if other is not None else read_load_1m()


def read_load_1m() -> float | None:
    """The 1-min load average, None where ``os.getloadavg`` is unavailable."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def machine_state(spread: float | None = None, load_1m: float | None = None) -> MachineState:
    """:func:`assess_machine` of this machine now (``load_1m`` None reads it).

    Args:
        spread: the run's timing spread, if measured.
        load_1m: a load reading taken earlier (e.g. the larger of the readings before and after a run).
    """
    return assess_machine(load_1m if load_1m is not None else read_load_1m(), os.cpu_count() or 1, spread)


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS tells, else ``os.cpu_count``)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass(frozen=True)
class ThreadChoice:
    """How many torch CPU threads a command uses, and why.

    Attributes:
        threads: the number set (``torch.set_num_threads``).
        cores: usable cores (:func:`usable_cores`).
        load_1m: the 1-min load average read at start (None where unknown).
        asked: True when ``--threads`` (or ``$OMP_NUM_THREADS``) gave the number.
        runnable: other processes runnable at start (:func:`read_runnable_others`; None where unknown).
        other_load: cores other processes kept busy at start (:func:`read_other_load`; None where
            unknown or not read).
    """

    threads: int
    cores: int
    load_1m: float | None
    asked: bool
    runnable: int | None = None
    other_load: float | None = None

    @property
    def reduced(self) -> bool:
        """True when the default took fewer threads than cores because other work holds them."""
        return not self.asked and self.threads < self.cores

    def summary(self) -> str:
        """One line: the choice and the reading behind it."""
        load = "unknown" if self.load_1m is None else f"{self.load_1m:.2f}"
        now = "" if self.runnable is None else f", {self.runnable} other processes runnable"
        busy = "" if self.other_load is None else f"other processes busy on {self.other_load:.1f} cores, "
        return (
            f"threads: {self.threads} of {self.cores} cores ({busy}1-min load average {load}{now} at start: "
            "other work holds the rest; pass --threads N to choose)"
        )


def default_threads(load_1m: float | None, cores: int) -> int:
    """Threads that fit beside the machine's other work: cores minus the load, rounded, at least 1.

    The 1-min load average counts runnable processes; each one busy on a core leaves one core fewer.
    Taking more threads than free cores oversubscribes them: torch's threads then wait for each
    other at every parallel region (measured on this project's 2-core machine under a load of 8-15:
    a 1-token SmolLM2 forward took 3,890 ms with 2 threads and 439 ms with 1).

    Args:
        load_1m: 1-min load average (None: unknown, all cores).
        cores: usable cores.

    Returns:
        ``max(1, min(cores, round(cores - load_1m)))``: 2 cores at load 0.3 -> 2, at 1.0 -> 1, at 8 -> 1.
    """
    if load_1m is None:
        return cores
    return max(1, min(cores, math.floor(cores - load_1m + 0.5)))


def choose_threads(asked: int | None) -> ThreadChoice:
    """``--threads``: the number asked, else ``$OMP_NUM_THREADS`` when set (torch's own rule), else
    :func:`default_threads` of the larger of the cores other processes keep busy now
    (:func:`read_other_load`; the 1-min load average where it cannot be read) and the processes
    runnable now. The 1-min average is only printed: it remembers work that has ended (the previous
    command of a script) and would take a core from a command that has both.

    Raises:
        ValueError: ``asked < 1``, or ``$OMP_NUM_THREADS`` not a positive integer.
    """
    cores, load, runnable = usable_cores(), read_load_1m(), read_runnable_others()
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if asked is None and env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"OMP_NUM_THREADS={env!r}: expected a positive integer (or unset it)")
        asked = int(env)
    if asked is not None:
        if asked < 1:
            raise ValueError(f"--threads={asked}: expected >= 1")
        return ThreadChoice(asked, cores, load, True, runnable)
    other = read_other_load()
    now = other if other is not None else load
    busy = max(x for x in (now, runnable, 0.0) if x is not None)
    return ThreadChoice(default_threads(busy, cores), cores, load, False, runnable, other)


def timing_machine(load_before: float | None, threads: int) -> MachineState:
    """The machine a cached timing was taken on: busy when other work competed for the cores.

    The load read *before* timing is what other processes put on the machine (our own timing
    would raise a later reading). Busy when that load plus the threads the timing used exceeds the
    cores by more than half a core (2 cores, 2 threads: quiet up to a load of 0.5; 1 thread: 1.5).

    Args:
        load_before: the cores other processes kept busy just before timing
            (:func:`read_competing_load`; None: unknown, counted quiet).
        threads: torch threads the timing ran with (``torch.get_num_threads()``).

    Returns:
        :class:`MachineState` (``timing_spread`` None; its ``load_1m`` field holds ``load_before``).
    """
    cores = usable_cores()
    busy = load_before is not None and load_before + threads > cores + 0.5
    reason = (
        f"other processes busy on {load_before:.2f} cores before timing + {threads} threads"
        f" > {cores} cores + 0.5"
        if busy
        else None
    )
    return MachineState(load_before, cores, None, busy, reason)


def run_machine(load_1m: float | None, others: float | None, threads: int) -> MachineState:
    """The machine a whole benchmark run was timed on: busy when other processes competed for the cores.

    Args:
        load_1m: the larger 1-min load average read before and after the run (recorded for reference:
            it counts the run's own threads, so it alone cannot tell a busy machine).
        others: the larger of :func:`read_competing_load` before and after the run (None: unknown,
            counted quiet).
        threads: torch threads the run used.

    Returns:
        :class:`MachineState`, busy when ``others + threads > cores + 0.5`` (as :func:`timing_machine`).
    """
    cores = usable_cores()
    busy = others is not None and others + threads > cores + 0.5
    reason = (
        f"other processes busy on {others:.2f} cores + {threads} threads > {cores} cores + 0.5"
        if busy
        else None
    )
    return MachineState(load_1m, cores, None, busy, reason)
