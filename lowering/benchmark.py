"""The benchmark stage's measurements: a ``.pte`` on the ExecuTorch runtime of this host.

    load        runtime.load_program + load_method of the program's methods, ms
    latency     one round (the model's calls: its example inputs once; a decoder: a prefill of
                ``prefill`` tokens, then ``decode`` single-token steps; a tiny program's calls
                repeated to last 0.5 ms), timed after ``warmup`` rounds, ``min_rounds`` rounds
                (compared with a previous program: until ``seconds`` passed too, at most
                ``max_rounds``): median, p90, ms
    tokens/s    a decoder's prefill tokens / median prefill call, decode steps / median decode time
    spread      p90 / median; above :data:`SPREAD_FLAG` the figures come from a loaded machine

With a ``previous`` program (last night's published one), both are loaded in ONE process
(each three times: the rounds rotate over the instances) and their rounds interleaved
(new, old, old, new, ...); the ratios new/old are recorded, the latency's as the median of
the round-by-round ratios of the CPU time this thread spent in each round (``time.thread_time``):
on a shared machine a wall-clock figure varies by ±30% from run to run, mostly the time
other processes held the CPU mid-call, which the thread's CPU time leaves out (two identical
portable CNN programs, 15 rounds, load average 6 on 2 cores: 0.85-1.02 by wall clock,
0.996-1.010 by CPU time).  (A backend that runs on a thread pool, XNNPACK, counts the calling
thread's share, which follows the whole.)  The figures themselves (latency, p90, tokens/s)
are wall-clock: what a user of the program waits.

ExecuTorch is looked up at run time (:func:`lowering.verify_executorch.executorch_runner`,
as verify's second runtime): without it the report says ``skipped``.  The measuring loop,
:func:`measure`, takes the runtime as its first argument so that it runs in this process
or in a fresh interpreter (a program that needs ExecuTorch's LLM kernels) alike.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import platform
import statistics
import time
from typing import Any, Sequence

#: p90 / median above which a report flags its figures as measured on a loaded machine.
SPREAD_FLAG = 1.5


@dataclasses.dataclass(frozen=True)
class BenchmarkSettings:
    """How long and what to measure; part of the benchmark stage's key (with the host)."""

    warmup: int = 3
    #: Loads of each program (interleaved; the median is reported).
    loads: int = 3
    min_rounds: int = 15
    max_rounds: int = 300
    seconds: float = 0.3
    #: A decoder's round: a prompt of ``prefill`` tokens, then ``decode`` single-token steps.
    prefill: int = 32
    decode: int = 16

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def of(cls, value: Any) -> "BenchmarkSettings | None":
        """A ``benchmark`` setting (true/None: the defaults; false: off; a mapping of fields)."""
        if value is False:
            return None
        if value is None or value is True:
            return cls()
        if isinstance(value, dict):
            unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
            if unknown:
                raise ValueError(f"benchmark: unknown settings {unknown}; allowed: "
                                 f"{[f.name for f in dataclasses.fields(cls)]}")
            return cls(**value)
        raise ValueError(f"benchmark: expected true, false or a mapping of settings, got {value!r}")


def host() -> dict[str, Any]:
    """Where the figures were measured: this host's CPU and thread count (a device differs)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "threads": os.cpu_count() or 1}


def load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def measure(runtime, programs: Sequence[Any], names: Sequence[str], calls: Sequence[tuple[str, list]],
            settings: dict, prefill_calls: int = 0) -> list[dict]:
    """Figures of each of ``programs`` (paths or bytes, or ``(path, .ptd path)`` of a program
    with external weights), run by ExecuTorch's ``runtime``:
    every method of ``names`` loaded, then rounds of ``calls`` ``[(method, flat inputs)]``
    interleaved between the programs (the order reversed every other round).  A decoder's
    first ``prefill_calls`` calls are its prefill, the rest decode steps."""
    settings = BenchmarkSettings(**settings)
    # Each program is loaded ``loads`` times, interleaved (the first load of a file pays its page
    # faults: the median is reported), and every loaded instance is kept: the rounds rotate over
    # them, so where one instance's planned memory happens to sit (its alignment) is averaged out.
    loads: list[list[float]] = [[] for _ in programs]
    instances: list[list[dict]] = [[] for _ in programs]
    for turn in range(settings.loads):
        for i in (range(len(programs)) if turn % 2 == 0 else reversed(range(len(programs)))):
            start = time.perf_counter()
            program = load(runtime, programs[i])
            methods = {name: program.load_method(name) for name in names}
            loads[i].append(time.perf_counter() - start)
            instances[i].append({**methods, "__program__": program})  # the program outlives its methods

    def one_round(methods: dict, repeat: int = 1) -> tuple[list[float], float]:
        """Each call's wall-clock seconds (the mean of ``repeat`` runs of the calls), and the
        round's CPU seconds of this thread."""
        times, cpu = [0.0] * len(calls), time.thread_time()
        for _ in range(repeat):
            for k, (name, inputs) in enumerate(calls):
                start = time.perf_counter()
                methods[name].execute(inputs)
                times[k] += time.perf_counter() - start
        return [t / repeat for t in times], time.thread_time() - cpu

    # Warm-up: ``warmup`` rounds of each program, over its instances (each at least once).
    for turn in range(max(settings.warmup, settings.loads)):
        for each in instances:
            warm = sum(one_round(each[turn % len(each)])[0])
    # A round of a tiny program repeats its calls to last MIN_ROUND_SECONDS: a few-microsecond
    # round is mostly the clocks' and the loop's own cost, which skewed its ratio (~0.97).
    repeat = max(1, min(REPEAT_LIMIT, math.ceil(MIN_ROUND_SECONDS / warm))) if warm > 0 else REPEAT_LIMIT
    rounds: list[list[list[float]]] = [[] for _ in programs]
    cpu: list[list[float]] = [[] for _ in programs]
    order = list(range(len(programs)))
    # Alone (nothing published to compare with: a first night), ``min_rounds`` give the trend's
    # figures; a comparison runs ``seconds`` too, for a steady ratio.
    seconds = settings.seconds if len(programs) > 1 else 0.0
    start, count = time.perf_counter(), 0
    while count < settings.max_rounds and (count < settings.min_rounds or time.perf_counter() - start < seconds):
        for i in (order if count % 2 == 0 else order[::-1]):
            times, used = one_round(instances[i][count % len(instances[i])], repeat)
            rounds[i].append(times)
            cpu[i].append(used)
        count += 1
    out = [figures(statistics.median(load), timed, prefill_calls, settings) for load, timed in zip(loads, rounds)]
    if len(rounds) == 2:  # new / old round by round, the median of those: see below
        out[0]["paired_latency_ratio"] = round(statistics.median(
            new / old for new, old in zip(cpu[0], cpu[1]) if old > 0), 4)
    return out


#: The shortest timed round (see :func:`measure`), and the most repeats of a round's calls in one.
MIN_ROUND_SECONDS, REPEAT_LIMIT = 0.0005, 100


def load(runtime, program: Any):
    """``runtime.load_program`` of a path or bytes, or of ``(path, .ptd path)`` with its external weights.

    A file of at most :data:`READ_LIMIT` bytes is read into fresh memory for each load: the
    runtime reads a mapped file's weights from the page cache's pages of that file, the same
    physical pages for every load, and where they fall in the CPU caches made one of two
    identical programs ~3-10% faster in every run (mlp/portable 0.90-0.92 with both mapped;
    0.99-1.01 read: each instance lands elsewhere, and the rounds rotate over them)."""
    path, data = program if isinstance(program, (tuple, list)) else (program, None)
    if isinstance(path, str) and os.path.getsize(path) <= READ_LIMIT:
        with open(path, "rb") as f:
            path = f.read()
    return runtime.load_program(path, data_path=data) if data else runtime.load_program(path)


#: Programs up to this size are read into memory for each load (:func:`load`); bigger ones
#: (an LLM) are mapped: ``loads`` copies of each of two programs would not fit.
READ_LIMIT = 64 << 20


def figures(load: float, rounds: list[list[float]], prefill_calls: int, settings: BenchmarkSettings) -> dict:
    """One program's figures from its timed rounds (seconds per call)."""
    totals = sorted(sum(r) for r in rounds)
    median = statistics.median(totals)
    p90 = totals[min(len(totals) - 1, int(round(0.9 * (len(totals) - 1))))]
    out = {"load_ms": round(load * 1e3, 3), "latency_ms": round(median * 1e3, 4), "p90_ms": round(p90 * 1e3, 4),
           "spread": round(p90 / median, 3) if median else None, "rounds": len(rounds)}
    if prefill_calls:
        prefill = statistics.median(sum(r[:prefill_calls]) for r in rounds)
        decode = statistics.median(sum(r[prefill_calls:]) for r in rounds)
        steps = len(rounds[0]) - prefill_calls
        out["prefill_tok_s"] = round(settings.prefill / prefill, 1) if prefill else None
        out["decode_tok_s"] = round(steps / decode, 1) if decode and steps else None
    return out


#: Figures compared new/old; for each, whether a higher value is worse.
RATIO_FIGURES = {"latency_ms": "latency", "p90_ms": "p90", "load_ms": "load",
                 "prefill_tok_s": "prefill_tok_s", "decode_tok_s": "decode_tok_s"}


def ratios(new: dict, old: dict) -> dict[str, float]:
    """new / old per figure both have (latency: above 1 is slower; tokens/s: above 1 is faster)."""
    return {name: round(new[key] / old[key], 4) for key, name in RATIO_FIGURES.items()
            if new.get(key) and old.get(key)}


def round_calls(module: Any, example_inputs: Sequence[Any], settings: BenchmarkSettings,
                method: str = "forward") -> tuple[list[tuple[str, list]], int]:
    """One round's calls ``[(method, flat inputs)]`` and how many of them are a prefill: a
    decoder that says its steps (``module.quick_calls(prefill, steps)``, as verify's quick
    check asks) is a prefill of ``settings.prefill`` tokens then ``settings.decode`` steps;
    any other model, its example inputs once."""
    from torch.utils import _pytree as pytree

    own = getattr(module, "quick_calls", None)
    if callable(own):
        return [(method, pytree.tree_leaves(tuple(c))) for c in own(settings.prefill, settings.decode)], 1
    return [(method, pytree.tree_leaves(tuple(example_inputs)))], 0


def benchmark_pte(pte: Any, names: Sequence[str], calls: Sequence[tuple[str, list]], settings: BenchmarkSettings,
                  previous: Any = None, prefill_calls: int = 0, data: Any = None, previous_data: Any = None) -> dict:
    """The report of ``pte`` (a path, or bytes), and of its ratios to ``previous`` when given
    (``data`` / ``previous_data``: the paths of their ``.ptd``, external weights):
    ``{"figures", "previous"?, "ratios"?, "host", "settings", "load_average"}``, or
    ``{"skipped": why}`` where ExecuTorch's runtime is not installed or cannot run it.  Where
    the previous program cannot run tonight's calls (the model's inputs changed), tonight's is
    timed alone and ``"not_compared"`` says why (no ratios: a latency gate has nothing to check)."""
    from .verify import delegate_backend_ids
    from .verify_executorch import executorch_runner, program_operators

    runner = executorch_runner()
    if runner is None:
        return {"skipped": "ExecuTorch's runtime is not installed"}
    missing = runner.missing_backends(delegate_backend_ids(pte)) or runner.missing_operators(program_operators(pte))
    if missing:
        return {"skipped": f"not runnable on ExecuTorch's runtime here: {missing}"}
    programs = [(os.fspath(p), os.fspath(d)) if d is not None else os.fspath(p) if isinstance(p, (str, os.PathLike)) else p
                for p, d in ((pte, data), (previous, previous_data)) if p is not None]
    calls = [(name, list(inputs)) for name, inputs in calls]
    measure_them = functools.partial(runner.call, pte, "lowering.benchmark:measure")
    not_compared = None
    try:
        measured = measure_them(programs, list(names), calls, settings.to_dict(), prefill_calls)
    except Exception as exc:  # the published program may not take tonight's inputs (another shape)
        if previous is None:
            raise
        measured = measure_them(programs[:1], list(names), calls, settings.to_dict(), prefill_calls)
        not_compared = f"the published program does not run tonight's calls: {type(exc).__name__}: {exc}"
    report: dict[str, Any] = {"figures": measured[0], "host": host(), "settings": settings.to_dict(),
                              "load_average": load_average()}
    if not_compared:
        report["not_compared"] = not_compared.splitlines()[0][:300]
    elif previous is not None:
        report["previous"] = measured[1]
        report["ratios"] = {**ratios(measured[0], measured[1]),
                            "latency": measured[0].pop("paired_latency_ratio")}
    return report


def combined(reports: dict[str, dict]) -> dict:
    """The report of a program of several methods from each method's (each timed on its own):
    a round is one call of each method (latency and p90 summed), the widest spread, the
    slowest load, and per ratio the worst method's (the highest: a regression of any method
    is the program's); ``{"skipped": why}`` if a method was not benchmarked.  The methods'
    own reports stay in ``"methods"``."""
    skipped = {m: r["skipped"] for m, r in reports.items() if r.get("skipped")}
    if skipped:
        return {"skipped": "; ".join(f"{m}: {why}" for m, why in skipped.items()), "methods": reports}
    first = next(iter(reports.values()))
    each = [r["figures"] for r in reports.values()]
    figures = {"load_ms": max(f["load_ms"] for f in each),
               "latency_ms": round(sum(f["latency_ms"] for f in each), 4),
               "p90_ms": round(sum(f["p90_ms"] for f in each), 4),
               "spread": max((f.get("spread") or 0) for f in each), "rounds": min(f["rounds"] for f in each)}
    out = {"figures": figures, "host": first["host"], "settings": first["settings"],
           "load_average": first.get("load_average"), "methods": reports}
    not_compared = [f"{m}: {r['not_compared']}" for m, r in reports.items() if r.get("not_compared")]
    if not_compared:
        out["not_compared"] = "; ".join(not_compared)
    if all(r.get("ratios") for r in reports.values()):
        out["ratios"] = {k: max(r["ratios"][k] for r in reports.values())
                         for k in first["ratios"] if all(k in r["ratios"] for r in reports.values())}
    return out


def not_runnable(verify: dict | None) -> str | None:
    """Why ExecuTorch's runtime here cannot run the program, as its verify report says (its
    ``executorch`` check skipped for missing backends or operators: a ReferenceBackend
    program), else None: the benchmark stage would only skip it, so it is not run."""
    for check in (verify or {}).get("checks") or []:
        why = check.get("skipped") or ""
        if check.get("runtime") == "executorch" and why.startswith(("backends not in", "operators not in")):
            return f"not runnable on ExecuTorch's runtime here ({why})"
    return None
