"""Binding a retrain's weights to a stored program (issue 29), the store's side: what the
``bind_weights`` stage (:func:`tasks.stages.run_bind_weights`) reads of last night's programs."""

from __future__ import annotations

from typing import Any

from .artifacts import get_doc, get_program, get_program_tables
from .store import ArtifactRef, ArtifactStore


def bind_from_tables(store: ArtifactStore, exported: dict, program: ArtifactRef, plan: Any, emitted: dict,
                     module: Any, recipe: dict | None, reference: ArtifactRef | None, derived: ArtifactRef | None,
                     runtime_ops: list[str] | None) -> dict | None:
    """:func:`tasks.stages.run_bind_weights` reading the tables of the exported and quantized
    programs, not their graphs (:func:`lowering.rebind.rebind_stored`; ``plan``: the memory plan
    the program was emitted with): the stage's result (the new ``.ptd`` stored) but its
    ``seconds``, ``{"fallback": why}``, or None (the quantize pass must run again: bind on the
    programs)."""
    from lowering.export.folding import folded_from_json
    from lowering.rebind import NotWeightsOnly, rebind_stored

    emitted_program = get_program(store, program)  # first: a portable target's is the exported one (then live)
    quantized = None
    if recipe and reference is not None and derived is not None:
        state_dict, constants = get_program_tables(store, reference)
        quantized = {**state_dict, **constants}
    try:
        ptd = rebind_stored(store.get_bytes(emitted["pte"]), plan, emitted_program,
                            get_program_tables(store, exported["program"]),
                            folded_from_json(get_doc(store, exported["folded"])), module, quantize=recipe,
                            quantized=quantized, derived=get_doc(store, derived) if quantized is not None else None,
                            mutated=exported.get("mutated_buffers", ()), runtime_ops=runtime_ops)
    except NotWeightsOnly as exc:
        return {"fallback": str(exc)}
    return None if ptd is None else {"ptd": store.put_bytes(ptd, "ptd"), "reference": None, "rebound": True,
                                     **({"quantized": "weights"} if recipe else {})}


def bind_methods_from_tables(store: ArtifactStore, exported: dict, methods: dict, plans: dict, emitted: dict,
                             modules: dict, constants: dict | None, recipe: dict | None, quantized: dict | None,
                             derived: dict | None, runtime_ops: list[str] | None) -> dict | None:
    """:func:`bind_from_tables` of a model of several methods (:func:`tasks.stages.run_bind_weights_methods`;
    ``plans``: each method's memory plan, ``modules``: each method's module)."""
    from lowering.export.folding import folded_from_json
    from lowering.rebind import NotWeightsOnly, rebind_stored_methods, stored_bindings

    programs = {m: (get_program(store, e["program"]), plans[m]) for m, e in methods.items()}  # first, as above
    bindings = {}
    try:
        for method, done in exported.items():
            tables = None
            if recipe and quantized and derived and derived.get(method) is not None:
                state_dict, constants_ = get_program_tables(store, quantized[method])
                tables = {**state_dict, **constants_}
            bindings[method] = stored_bindings(
                get_program_tables(store, done["program"]), folded_from_json(get_doc(store, done["folded"])),
                modules[method], quantize=recipe, quantized=tables,
                derived=get_doc(store, derived[method]) if tables is not None else None,
                mutated=done.get("mutated_buffers", ()))
            if bindings[method] is None:
                return None
        ptd = rebind_stored_methods(store.get_bytes(emitted["pte"]), programs, constants or {}, bindings,
                                    runtime_ops=runtime_ops)
    except NotWeightsOnly as exc:
        return {"fallback": str(exc)}
    return {"ptd": store.put_bytes(ptd, "ptd"), "references": None, "rebound": True,
            **({"quantized": "weights"} if recipe else {})}
