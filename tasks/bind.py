"""Binding a retrain's weights to a stored program (issue 29), the store's side: what the
``bind_weights`` stage (:func:`tasks.stages.run_bind_weights`) reads of last night's programs."""

from __future__ import annotations

from typing import Any

from .artifacts import get_doc, get_program, get_program_tables
from .store import ArtifactRef, ArtifactStore


def bind_from_tables(store: ArtifactStore, exported: dict, program: ArtifactRef, plan: Any, emitted: dict,
                     module: Any, recipe: dict | None, reference: ArtifactRef | None, derived: ArtifactRef | None,
                     runtime_ops: list[str] | None) -> "bytes | dict | None":
    """:func:`tasks.stages.run_bind_weights` reading the tables of the exported and quantized
    programs, not their graphs (:func:`lowering.rebind.rebind_stored`; ``plan``: the memory plan
    the program was emitted with): the new ``.ptd``, ``{"fallback": why}``, or None (the
    quantize pass must run again: bind on the programs)."""
    from lowering.export.folding import folded_from_json
    from lowering.rebind import NotWeightsOnly, rebind_stored

    quantized = None
    if recipe and reference is not None and derived is not None:
        state_dict, constants = get_program_tables(store, reference)
        quantized = {**state_dict, **constants}
    try:
        return rebind_stored(store.get_bytes(emitted["pte"]), plan, get_program(store, program),
                             get_program_tables(store, exported["program"]),
                             folded_from_json(get_doc(store, exported["folded"])), module, quantize=recipe,
                             quantized=quantized, derived=get_doc(store, derived) if quantized is not None else None,
                             mutated=exported.get("mutated_buffers", ()), runtime_ops=runtime_ops)
    except NotWeightsOnly as exc:
        return {"fallback": str(exc)}
