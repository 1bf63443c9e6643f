"""What a dry run (``lowerflow plan``: :func:`flows.lower_model.plan_model`) must know to list
the stages a cache miss leaves: which targets quantize, verify, benchmark and bind weights,
and whether the program has cond / map (probed only when a miss leaves stages to list)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from .quantized import QuantSettings


@dataclasses.dataclass(frozen=True)
class DryRun:
    """What a dry run (``plan``) must know to list the stages a miss leaves: which targets
    quantize, which verify (``verify: off`` runs no verify stage), which are benchmarked,
    and whether the program has cond / map (stage ``lower_control_flow``)."""

    quantized: frozenset = frozenset()
    #: The targets whose verify mode is ``off``.
    unverified: frozenset = frozenset()
    #: The plan's :class:`~flows.gates.Publisher`: where the benchmark stage runs, and (it
    #: reads what is published) its inputs.  None: no benchmark stage.
    benchmark: Any = None
    #: ``() -> bool``: whether the program has cond / map; asked only when a miss leaves
    #: stages to list (reading the program costs time a fully cached plan need not spend).
    control_flow: Any = None
    #: The targets keyed on the model's structure (stage ``bind_weights`` after emit: flows/weights_only.py).
    bound: frozenset = frozenset()
    #: The targets whose partitioner keeps ops whole: a second export, their own, before their stages.
    kept: frozenset = frozenset()

    @classmethod
    def of(cls, quant: QuantSettings, targets, verify: dict[str, str], benchmark: Any = None,
           bound: frozenset = frozenset(), kept: frozenset = frozenset()) -> "DryRun":
        """``verify``: each target's mode (:func:`flows.verify_mode.target_mode`)."""
        return cls(frozenset(t for t in targets if quant.recipe(t) is not None),
                   frozenset(t for t in targets if verify[t] == "off"), benchmark=benchmark, bound=bound, kept=kept)

    def with_control_flow(self, probe) -> "DryRun":
        return dataclasses.replace(self, control_flow=functools.lru_cache(maxsize=1)(probe))

    def rest(self, target: str, stages: tuple[str, ...]) -> tuple[str, ...]:
        """``stages`` (what follows export) with ``quantize``, ``lower_control_flow`` and
        ``benchmark`` where they run, a kept-ops target's own ``export`` first, without ``verify``
        where it is off."""
        if target in self.unverified:
            stages = tuple(s for s in stages if s != "verify")
        if self.benchmark is not None and self.benchmark.benchmarked(target):
            stages = (*stages, "benchmark")
        if target in self.quantized:
            stages = ("quantize", *stages)
        if target in self.kept:  # its own export (lowering.targets.keep_for), after the model's
            stages = ("export", *stages)
        for emit in ("emit", "emit_methods"):
            if target in self.bound and emit in stages:
                at = stages.index(emit) + 1
                stages = (*stages[:at], "bind_weights" + emit.removeprefix("emit"), *stages[at:])
        if "adjust" in stages and self.control_flow is not None and self.control_flow():
            at = stages.index("adjust") + 1
            stages = (*stages[:at], "lower_control_flow", *stages[at:])
        return stages


def stored_control_flow(run: Any, program) -> bool:
    """Whether the cached exported program ``program`` (a ref) has cond / map nodes."""
    from lowering.control_flow_graph import control_flow_nodes
    from tasks.artifacts import get_program

    store = getattr(run, "store", None)
    if store is None:
        return False
    try:
        return bool(control_flow_nodes(get_program(store, program).graph))
    except Exception:  # an unreadable program: the real run will say so
        return False


def exported_control_flow(loaded) -> bool:
    """Whether the model, exported now in memory (a dry run whose export is not cached),
    has cond / map nodes; False when it cannot be exported (the run will say why)."""
    from lowering.control_flow_graph import control_flow_nodes
    from lowering.export import export

    if loaded.module is None:
        return False
    try:
        program = export(loaded.module, loaded.inputs, dynamic_shapes=loaded.dynamic_shapes)
    except Exception:
        return False
    return bool(control_flow_nodes(program.graph))
