"""Binding a retrain's weights to a stored program (issue 29), the store's side: what the
``bind_weights`` stage (:func:`tasks.stages.run_bind_weights`) reads of last night's programs."""

from __future__ import annotations

from typing import Any

from lowering.serialize import EVERY_ENTRY, canonical_json

from .artifacts import get_doc, get_program, get_program_tables, put_doc
from .store import ArtifactRef, ArtifactStore, sha256_hex


def bind_from_tables(store: ArtifactStore, exported: dict, program: ArtifactRef, plan: Any, emitted: dict,
                     module: Any, recipe: dict | None, reference: ArtifactRef | None, derived: ArtifactRef | None,
                     runtime_ops: list[str] | None, references: bool = False) -> dict | None:
    """:func:`tasks.stages.run_bind_weights` reading the tables of the exported and quantized
    programs, not their graphs (:func:`lowering.rebind.stored_bindings`; ``plan``: the memory plan
    the program was emitted with): the stage's result (the new ``.ptd`` stored) but its
    ``seconds``, ``{"fallback": why}``, or None (the quantize pass must run again: bind on the
    programs).  The ``.ptd`` is written from emit's recipes (:func:`replayed`) where they hold,
    else by binding the emitted program again (its graph read, every delegate preprocessed, the
    ``.pte`` emitted again and compared).  ``references``: with a recipe, also verify's quantized
    program with tonight's weights (:func:`rebound_reference`: last night's with new tables)."""
    from lowering.export.folding import folded_from_json
    from lowering.rebind import NotWeightsOnly, emit_bound_ptd, replaced_names, stored_bindings

    replay = emitted.get("recipes") is not None
    emitted_program = None if replay else get_program(store, program)  # first: a portable target's is live
    quantized, checked = None, False
    if recipe and reference is not None and derived is not None:
        checked = as_recorded(store, exported["program"], reference, derived)  # else compared here, read back
        state_dict, constants = get_program_tables(store, reference, EVERY_ENTRY if checked else frozenset())
        quantized = {**state_dict, **constants}
    try:
        folded = folded_from_json(get_doc(store, exported["folded"]))
        skip = replaced_names(module, folded) if not recipe or checked else frozenset()
        bindings = stored_bindings(get_program_tables(store, exported["program"], skip), folded, module,
                                   quantize=recipe, quantized=quantized, derived=get_doc(store, derived)
                                   if quantized is not None else None, mutated=exported.get("mutated_buffers", ()),
                                   checked=checked)
        if bindings is None:
            return None
        new_reference = None
        if quantized is not None and references:
            new_reference = rebound_reference(store, reference, bindings, exported.get("mutated_buffers", ()))
            if new_reference is None:
                return None
        ptd = replayed(store, emitted, bindings) if replay else None
        how = "replayed" if ptd is not None else "rebound"
        if ptd is None:
            ptd = [emit_bound_ptd(emitted_program or get_program(store, program), bindings, plan,
                                  store.get_bytes(emitted["pte"]), runtime_ops)]
    except NotWeightsOnly as exc:
        return {"fallback": str(exc)}
    return {"ptd": store.put_parts(ptd, "ptd"), "reference": new_reference, "rebound": True, "ptd_from": how,
            **({"quantized": "weights"} if recipe else {})}


def note_as_recorded(store: ArtifactStore, source: ArtifactRef, quantized: ArtifactRef, derived: ArtifactRef) -> None:
    """Remember (a store memo) that the ``quantized`` program holds what ``derived`` records of the
    weights of ``source`` (:func:`lowering.rebind.quantized_as_recorded`, checked by the quantize
    stage on the live programs): a retrain's bind then reads neither program's weights back."""
    store.put_memo(*_as_recorded(source, quantized, derived))


def as_recorded(store: ArtifactStore, source: ArtifactRef, quantized: ArtifactRef, derived: ArtifactRef) -> bool:
    """Whether the quantize stage noted the three as recorded (:func:`note_as_recorded`)."""
    key, value = _as_recorded(source, quantized, derived)
    return store.get_memo(key) == value


def _as_recorded(source: ArtifactRef, quantized: ArtifactRef, derived: ArtifactRef) -> tuple[str, dict]:
    """The note's memo key and value: the three objects' digests."""
    value = {"source": source.sha256, "quantized": quantized.sha256, "derived": derived.sha256}
    return f"as-recorded-{sha256_hex(canonical_json(value))}", value


def rebound_reference(store: ArtifactStore, reference: ArtifactRef, bindings: dict,
                      mutated: Any = ()) -> ArtifactRef | None:
    """Verify's quantized program with tonight's weights: the stored quantized program
    ``reference`` with every table entry from ``bindings`` (the quantized program's tables
    again, :func:`lowering.rebind.requantized_tables`; ``mutated`` buffers keep their value),
    written without reading its graph (:func:`lowering.serialize.with_new_tables`); None when
    an entry has no new value (then the program is bound the slow way)."""
    from lowering.serialize import with_new_tables

    serialized = with_new_tables(store.get_bytes(reference), bindings, kept=frozenset(mutated))
    if serialized is None:
        return None
    store.put_blobs(serialized.blobs.values())
    return store.put_bytes(serialized.manifest, "program")


def replayed(store: ArtifactStore, emitted: dict, bindings: dict) -> list | None:
    """The ``.ptd`` of ``bindings`` written from the recipes emit recorded (``emitted["recipes"]``,
    :mod:`lowering.ptd_recipes`) as its parts (:func:`lowering.ptd_recipes.replay_parts`), or None
    where they do not hold (unproven, another weight dtype, a pinned weight changed): then the
    program is bound again."""
    from lowering.ptd_recipes import replay_parts
    from lowering.rebind import NotWeightsOnly

    try:
        return replay_parts(get_doc(store, emitted["recipes"]), bindings)
    except NotWeightsOnly:
        return None


def record_recipes(store: ArtifactStore, methods: dict, pte: bytes, ptd: Any, constants: dict | None,
                   runtime_ops: list[str] | None) -> dict:
    """Emit's ``{"recipes": ref}``: how each entry of ``ptd`` (the ``.ptd``'s bytes, or the entries
    it was written from) derives from the weights of the program ``pte``
    (:func:`lowering.ptd_recipes.record_recipes`, checked on perturbed weights), what a retrain's
    bind writes its ``.ptd`` from.  ``methods``: ``{name: (delegated program, memory plan)}``; one
    entry, None as its name: a program of one method (``constants``: a program of several
    methods' constant methods)."""
    from lowering.ptd_recipes import record_recipes as record, tables_of
    from lowering.rebind import emit_bound_entries, rebind_stored_methods

    tables: dict = {}
    for program, _ in methods.values():
        for name, tensor in tables_of(program).items():
            tables.setdefault(name, tensor)
    if list(methods) == [None]:
        program, plan = methods[None]
        doc = record(lambda bindings: emit_bound_entries(program, bindings, plan, pte, runtime_ops), tables, ptd)
    else:
        doc = record(lambda bindings: rebind_stored_methods(
            pte, methods, constants or {}, {m: bindings for m in methods}, runtime_ops, entries=True), tables, ptd)
    return {"recipes": put_doc(store, doc, "ptd_recipes")}


def bind_methods_from_tables(store: ArtifactStore, exported: dict, methods: dict, plans: dict, emitted: dict,
                             modules: dict, constants: dict | None, recipe: dict | None, quantized: dict | None,
                             derived: dict | None, runtime_ops: list[str] | None,
                             references: bool = False) -> dict | None:
    """:func:`bind_from_tables` of a model of several methods (:func:`tasks.stages.run_bind_weights_methods`;
    ``plans``: each method's memory plan, ``modules``: each method's module; ``references``: as there,
    each method's)."""
    from lowering.export.folding import folded_from_json
    from lowering.rebind import NotWeightsOnly, rebind_stored_methods, replaced_names, stored_bindings

    replay = emitted.get("recipes") is not None
    programs = None if replay else {m: (get_program(store, e["program"]), plans[m]) for m, e in methods.items()}
    bindings = {}
    try:
        for method, done in exported.items():
            tables, checked = None, False
            if recipe and quantized and derived and derived.get(method) is not None:
                checked = as_recorded(store, done["program"], quantized[method], derived[method])
                state_dict, constants_ = get_program_tables(store, quantized[method],
                                                            EVERY_ENTRY if checked else frozenset())
                tables = {**state_dict, **constants_}
            folded = folded_from_json(get_doc(store, done["folded"]))
            skip = replaced_names(modules[method], folded) if not recipe or checked else frozenset()
            bindings[method] = stored_bindings(
                get_program_tables(store, done["program"], skip), folded, modules[method], quantize=recipe,
                quantized=tables,
                derived=get_doc(store, derived[method]) if tables is not None else None,
                mutated=done.get("mutated_buffers", ()), checked=checked)
            if bindings[method] is None:
                return None
        new_references = None
        if recipe and references:
            new_references = {m: rebound_reference(store, quantized[m], bindings[m],
                                                   exported[m].get("mutated_buffers", ())) for m in exported}
            if None in new_references.values():
                return None
        merged: dict = {}
        for tables in bindings.values():
            for name, tensor in tables.items():
                merged.setdefault(name, tensor)
        ptd = replayed(store, emitted, merged) if replay else None
        how = "replayed" if ptd is not None else "rebound"
        if ptd is None:
            programs = programs or {m: (get_program(store, e["program"]), plans[m]) for m, e in methods.items()}
            ptd = [rebind_stored_methods(store.get_bytes(emitted["pte"]), programs, constants or {}, bindings,
                                         runtime_ops=runtime_ops)]
    except NotWeightsOnly as exc:
        return {"fallback": str(exc)}
    return {"ptd": store.put_parts(ptd, "ptd"), "references": new_references, "rebound": True, "ptd_from": how,
            **({"quantized": "weights"} if recipe else {})}
