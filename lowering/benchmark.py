"""The benchmark stage's measurements: a ``.pte`` on the ExecuTorch runtime of this host.

    load        runtime.load_program + load_method of the program's methods, ms
    latency     one round (the model's calls: its example inputs once; a decoder: a prefill of
                ``prefill`` tokens, then ``decode`` single-token steps), timed after ``warmup``
                rounds, until ``seconds`` passed (``min_rounds`` .. ``max_rounds``): median, p90, ms
    tokens/s    a decoder's prefill tokens / median prefill call, decode steps / median decode time
    spread      p90 / median; above :data:`SPREAD_FLAG` the figures come from a loaded machine

With a ``previous`` program (last night's published one), both are loaded in ONE process
and their rounds interleaved call by call (new, old, old, new, ...), and the ratios new/old
of the medians are recorded: on a shared machine a figure varies by ±30% from run to run,
the ratio of two programs timed side by side by a few percent.

ExecuTorch is looked up at run time (:func:`lowering.verify_executorch.executorch_runner`,
as verify's second runtime): without it the report says ``skipped``.  The measuring loop,
:func:`measure`, takes the runtime as its first argument so that it runs in this process
or in a fresh interpreter (a program that needs ExecuTorch's LLM kernels) alike.
"""

from __future__ import annotations

import dataclasses
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
    max_rounds: int = 400
    seconds: float = 0.5
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
    """Figures of each of ``programs`` (paths or bytes), run by ExecuTorch's ``runtime``:
    every method of ``names`` loaded, then rounds of ``calls`` ``[(method, flat inputs)]``
    interleaved between the programs (the order reversed every other round).  A decoder's
    first ``prefill_calls`` calls are its prefill, the rest decode steps."""
    settings = BenchmarkSettings(**settings)
    loads: list[list[float]] = [[] for _ in programs]
    for turn in range(settings.loads):  # the first load of a file pays its page faults: interleaved, median
        loaded = []
        for i in (range(len(programs)) if turn % 2 == 0 else reversed(range(len(programs)))):
            start = time.perf_counter()
            program = runtime.load_program(programs[i])
            methods = {name: program.load_method(name) for name in names}
            loads[i].append(time.perf_counter() - start)
            loaded.append((i, {**methods, "__program__": program}))  # the program outlives its methods
        loaded = [methods for _, methods in sorted(loaded, key=lambda pair: pair[0])]

    def one_round(methods: dict) -> list[float]:
        times = []
        for name, inputs in calls:
            start = time.perf_counter()
            methods[name].execute(inputs)
            times.append(time.perf_counter() - start)
        return times

    for _ in range(settings.warmup):
        for methods in loaded:
            one_round(methods)
    rounds: list[list[list[float]]] = [[] for _ in loaded]
    order = list(range(len(loaded)))
    start, count = time.perf_counter(), 0
    while count < settings.max_rounds and (count < settings.min_rounds or time.perf_counter() - start < settings.seconds):
        for i in (order if count % 2 == 0 else order[::-1]):
            rounds[i].append(one_round(loaded[i]))
        count += 1
    return [figures(statistics.median(load), timed, prefill_calls, settings) for load, timed in zip(loads, rounds)]


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
                  previous: Any = None, prefill_calls: int = 0) -> dict:
    """The report of ``pte`` (a path, or bytes), and of its ratios to ``previous`` when given:
    ``{"figures", "previous"?, "ratios"?, "host", "settings", "load_average"}``, or
    ``{"skipped": why}`` where ExecuTorch's runtime is not installed or cannot run it."""
    from .verify import delegate_backend_ids
    from .verify_executorch import executorch_runner, program_operators

    runner = executorch_runner()
    if runner is None:
        return {"skipped": "ExecuTorch's runtime is not installed"}
    missing = runner.missing_backends(delegate_backend_ids(pte)) or runner.missing_operators(program_operators(pte))
    if missing:
        return {"skipped": f"not runnable on ExecuTorch's runtime here: {missing}"}
    programs = [os.fspath(p) if isinstance(p, (str, os.PathLike)) else p for p in (pte, previous) if p is not None]
    calls = [(name, list(inputs)) for name, inputs in calls]
    measured = runner.call(pte, "lowering.benchmark:measure", programs, list(names), calls, settings.to_dict(),
                           prefill_calls)
    report: dict[str, Any] = {"figures": measured[0], "host": host(), "settings": settings.to_dict(),
                              "load_average": load_average()}
    if previous is not None:
        report["previous"] = measured[1]
        report["ratios"] = ratios(measured[0], measured[1])
    return report
