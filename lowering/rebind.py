"""Weights-only updates: a retrained model (same program, new weights) bound to last night's
lowered program, without exporting, partitioning or planning again.

    previous = lower(model_w1, x, partitioner=p, external_weights=True)
    tonight = rebind_weights(previous, model_w2)        # ~ the cost of preprocessing weights
    tonight.pte == previous.pte; tonight.ptd: model_w2's weights

How (every step keyed on names, never on bytes)::

    previous.source_program (edge, fp32)  ── state_dict swapped by FQN, folded views redone ──► E'
    E' ── quantize (the same recipe; dynamic recipes only) ──► Q'        bindings: target -> tensor
    previous.exported_program (delegated) ── every constant swapped by target from the bindings,
        every delegate preprocessed again on its new weights (payload must not change) ──► D'
    emit(D', previous.memory_plan, external_weights) ──► .pte (must equal previous.pte) + .ptd

What is not a weights-only update raises :class:`NotWeightsOnly` naming why (then lower
again): another architecture (a weight missing or of another shape), a recipe that
calibrates (``int8`` static: activation parameters are in the program), a delegate
payload that depends on weight values (per-tensor quantization parameters inline), a view
of a weight whose source cannot be told, control flow.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

import torch
from torch.export import ExportedProgram

from .errors import LoweringError



class NotWeightsOnly(LoweringError):
    """The new weights cannot be bound to the previous program; the message says why."""


def rebind_weights(previous: Any, model: "torch.nn.Module | Mapping[str, torch.Tensor]", *,
                   quantize: Any = None, runtime_ops: Any = None) -> Any:
    """``previous`` (a :class:`~lowering.lower.LowerResult` of ``external_weights=True``) with the
    weights of ``model`` (a module of the same architecture, or its state_dict): a new
    LowerResult whose ``.pte`` is byte-identical to ``previous.pte`` and whose ``.ptd`` holds
    the new weights.  ``quantize``: the recipe ``previous`` was lowered with.  Raises
    :class:`NotWeightsOnly` when that cannot be (see the module docstring)."""
    from .lower import LowerResult, MethodsLowerResult

    if isinstance(previous, MethodsLowerResult):
        return _rebind_methods(previous, model, quantize, runtime_ops)
    if previous.ptd is None or getattr(previous, "source_program", None) is None:
        raise NotWeightsOnly("the previous program was not lowered with external_weights=True")
    timings: dict[str, float] = {}
    start = time.perf_counter()
    source, bindings, quantized, how = _bindings(previous.source_program, _state_of(model), quantize,
                                                 getattr(previous, "quantized_program", None))
    timings["bind"] = time.perf_counter() - start
    if how is not None:  # "quantize_weights" (the recorded recipes) or "quantize_pass" (the graph pass again)
        timings[how] = timings["bind"]
    program, ptd = _emit_bound(previous.exported_program, bindings, previous.memory_plan, previous.pte,
                               runtime_ops, timings)
    return LowerResult(pte=previous.pte, memory_plan=previous.memory_plan, exported_program=program, timings=timings,
                       ptd=ptd, source_program=source, quantized_program=quantized)


def rebind_stored(pte: bytes, memory_plan: Any, program: ExportedProgram, source: tuple[Mapping, Mapping],
                  folded: Mapping[str, tuple], model: "torch.nn.Module | Mapping[str, torch.Tensor]", *,
                  quantize: Any = None, quantized: Mapping[str, torch.Tensor] | None = None,
                  derived: Mapping[str, dict] | None = None, mutated: Any = (), runtime_ops: Any = None) -> bytes | None:
    """:func:`rebind_weights` from what a store keeps of the previous lowering, reading no graph
    but the one emitted again: ``pte``, ``memory_plan`` and ``program`` (delegated) as
    emitted, the exported program's tables ``source`` (``(state_dict, constants)``) and folded
    views ``folded`` (:func:`folded_views`), the weights of ``model``; with a ``quantize`` recipe
    the quantized program's constants ``quantized`` and how its pass derived them ``derived``
    (its ``DERIVED_META``), ``mutated``: the buffers the program mutates.  Returns the new
    ``.ptd``, or None when the quantize pass must run again (then :func:`rebind_weights` on the
    programs); raises :class:`NotWeightsOnly` as it does."""
    bindings = stored_bindings(source, folded, model, quantize=quantize, quantized=quantized, derived=derived,
                               mutated=mutated)
    return None if bindings is None else _emit_bound(program, bindings, memory_plan, pte, runtime_ops)[1]


def rebind_stored_methods(pte: bytes, methods: Mapping[str, tuple[ExportedProgram, Any]], constant_methods: Mapping,
                          bindings: Mapping[str, Mapping[str, torch.Tensor]], runtime_ops: Any = None,
                          entries: bool = False) -> Any:
    """:func:`rebind_stored` of a program of several methods: ``methods`` ``{name: (delegated
    program, memory plan)}`` as emitted with ``constant_methods``, each bound to its
    :func:`stored_bindings`; the new ``.ptd`` (the ``.pte`` emitted again must be ``pte``), or
    with ``entries`` its entries unserialized (as :func:`emit_bound_entries`)."""
    from .external import program_files
    from .methods import build_methods_pte

    built = build_methods_pte({name: (rebound_program(program, bindings[name]), plan)
                               for name, (program, plan) in methods.items()},
                              dict(constant_methods), runtime_ops=runtime_ops, external_weights=True)
    new_pte, ptd = program_files(built, not entries)
    _check_same(new_pte, pte)
    return built.external if entries else ptd


def stored_bindings(source: tuple[Mapping, Mapping], folded: Mapping[str, tuple],
                    model: "torch.nn.Module | Mapping[str, torch.Tensor]", *, quantize: Any = None,
                    quantized: Mapping[str, torch.Tensor] | None = None, derived: Mapping[str, dict] | None = None,
                    mutated: Any = (), checked: bool = False) -> dict[str, torch.Tensor] | None:
    """target -> tensor of every weight of the program lowered from the exported program whose
    tables are ``source`` (see :func:`rebind_stored`), for the weights of ``model``; None when
    the quantize pass must run again.  ``checked``: the quantized tables are known to be what
    ``derived`` records of the source's (:func:`derivations_hold`, when they were made): neither
    table's values are compared (they may be ``meta`` tensors)."""
    state_dict, constants = source
    _check_views(constants, folded)
    state_dict2, constants2 = bound_tables(state_dict, constants, folded, _state_of(model))
    new_tables = {k: v for k, v in {**state_dict2, **constants2}.items() if isinstance(v, torch.Tensor)}
    if quantize is None:
        return new_tables
    _check_recipe(quantize)
    if quantized is None or derived is None:
        return None
    old_tables = {k: v for k, v in {**state_dict, **constants}.items() if isinstance(v, torch.Tensor)}
    return requantized_tables(quantized, derived, old_tables, new_tables, mutated, checked=checked)


def replaced_names(model: "torch.nn.Module | Mapping[str, torch.Tensor]", folded: Mapping[str, tuple]) -> frozenset:
    """The entries of an exported program's tables whose values :func:`stored_bindings` (without a
    recipe) takes from the weights of ``model`` alone: its parameters and buffers and the views
    export folded of them (``folded``).  Their stored values need not be read (only the entries'
    dtypes and shapes: :func:`lowering.serialize.deserialize_tables`'s ``skip``)."""
    names = model.state_dict(keep_vars=True).keys() if isinstance(model, torch.nn.Module) else model.keys()
    return frozenset(names) | frozenset(folded)


def emit_bound_ptd(program: ExportedProgram, bindings: Mapping[str, torch.Tensor], memory_plan: Any,
                   previous: bytes, runtime_ops: Any = None) -> bytes:
    """The ``.ptd`` of the delegated ``program`` bound to ``bindings`` (every delegate preprocessed
    again); raises :class:`NotWeightsOnly` unless its ``.pte`` is ``previous`` byte for byte."""
    return _emit_bound(program, bindings, memory_plan, previous, runtime_ops)[1]


def emit_bound_entries(program: ExportedProgram, bindings: Mapping[str, torch.Tensor], memory_plan: Any,
                       previous: bytes, runtime_ops: Any = None) -> Mapping[str, Any]:
    """:func:`emit_bound_ptd`'s ``.ptd`` as its entries (key -> :class:`~lowering.pte.flat_tensor.PtdEntry`),
    not serialized: what the check of the ``.ptd`` recipes compares (:mod:`lowering.ptd_recipes`),
    without the bytes of a second ``.ptd`` in memory."""
    from .emit.method import build_pte
    from .external import program_files

    built = build_pte(rebound_program(program, bindings), memory_plan, runtime_ops=runtime_ops, external_weights=True)
    _check_same(program_files(built, False)[0], previous)
    return built.external


def _emit_bound(program: ExportedProgram, bindings: Mapping[str, torch.Tensor], memory_plan: Any, previous: bytes,
                runtime_ops: Any, timings: dict | None = None) -> tuple[ExportedProgram, bytes]:
    """(``program`` bound to ``bindings`` (:func:`rebound_program`), its ``.ptd``); its ``.pte``
    emitted again must be ``previous`` byte for byte."""
    from .emit.method import build_pte
    from .external import program_files

    timings = {} if timings is None else timings
    start = time.perf_counter()
    bound = rebound_program(program, bindings)
    timings["preprocess"] = time.perf_counter() - start
    start = time.perf_counter()
    pte, ptd = program_files(build_pte(bound, memory_plan, runtime_ops=runtime_ops, external_weights=True), True)
    timings["emit"] = time.perf_counter() - start
    _check_same(pte, previous)
    return bound, ptd


def _rebind_methods(previous: Any, model: Any, quantize: Any, runtime_ops: Any) -> Any:
    """:func:`rebind_weights` of a program of several methods (``model``: ``{method: module}``,
    or one module / state_dict every method reads its weights from)."""
    from .external import program_files
    from .lower import MethodsLowerResult
    from .methods import build_methods_pte

    if previous.ptd is None or not previous.source_programs:
        raise NotWeightsOnly("the previous program was not lowered with external_weights=True")
    sources, programs, quantized, timings = {}, {}, {}, {}
    before = previous.quantized_programs or {}
    for name, source in previous.source_programs.items():
        start = time.perf_counter()
        state = _state_of(model[name] if isinstance(model, Mapping) and name in model else model)
        sources[name], bindings, quantized[name], how = _bindings(source, state, quantize, before.get(name))
        programs[name] = rebound_program(previous.exported_programs[name], bindings)
        timings[name] = {how or "bind": time.perf_counter() - start}
    built = build_methods_pte({name: (programs[name], previous.memory_plans[name]) for name in programs},
                              previous.constant_methods, runtime_ops=runtime_ops, external_weights=True)
    pte, ptd = program_files(built, True)
    _check_same(pte, previous.pte)
    return MethodsLowerResult(pte=pte, memory_plans=previous.memory_plans, exported_programs=programs, ptd=ptd,
                              timings=timings, source_programs=sources, constant_methods=previous.constant_methods,
                              quantized_programs=quantized if quantize is not None else None)



def _state_of(model: Any) -> dict[str, torch.Tensor]:
    if isinstance(model, torch.nn.Module):
        return {k: v.detach() for k, v in model.state_dict(keep_vars=False).items()}
    return {k: v.detach() for k, v in dict(model).items()}


def _bindings(source: ExportedProgram, state: Mapping[str, torch.Tensor], quantize: Any,
              quantized_before: ExportedProgram | None = None):
    """(the source program bound to ``state``, target -> tensor of every weight after quantize,
    the quantized program or None).  ``quantized_before``: the previous lowering's quantized
    program; where its pass recorded how it computed each constant, only the weights are
    quantized (:func:`requantized_weights`: ``"quantize_weights"``), else the pass runs again
    (``"quantize_pass"``); the 4th item says which (None without a recipe)."""
    bound = bind_source(source, state)
    if quantize is None:
        return bound, _tensors(bound), None, None
    from .quantize import quantize as quantize_program

    recipe = _check_recipe(quantize)
    tensors = requantized_weights(quantized_before, source, bound) if quantized_before is not None else None
    if tensors is not None:
        from .program import with_tables

        quantized = with_tables(quantized_before)
        _swap(quantized, tensors, "the quantized program")
        return bound, tensors, quantized, "quantize_weights"
    quantized = quantize_program(bound, recipe)
    return bound, _tensors(quantized), quantized, "quantize_pass"


def _check_recipe(quantize: Any) -> Any:
    """The parsed recipe, if a weights-only update can requantize with it (not ``int8`` static)."""
    from .quantize import parse_recipe

    recipe = parse_recipe(quantize)
    if recipe.to_dict().get("recipe") == "int8":
        raise NotWeightsOnly("recipe int8 (static) calibrates activations on the model: its activation "
                             "quantization parameters are in the program, so new weights need a new program")
    return recipe


def requantized_weights(quantized: ExportedProgram, source: ExportedProgram,
                        bound: ExportedProgram) -> dict[str, torch.Tensor] | None:
    """Every constant of the ``quantized`` program (quantized from ``source``) for the weights of
    ``bound`` (``source`` with new weights), computed from the recipes its quantize pass recorded
    (:data:`lowering.quantize.graph.DERIVED_META`: a transpose, a group quantization), without
    the graph pass.  None (the pass runs again) unless every constant is either a weight of
    ``source`` by name, with its bytes, or has a recipe whose recorded digests say it is the
    constant as computed from the source ``source`` holds (so nothing the pass changed
    otherwise is ever bound by name or by recipe)."""
    from .quantize.graph import DERIVED_META

    return requantized_tables(_tensors(quantized), quantized.graph_module.meta.get(DERIVED_META) or {},
                              _tensors(source), _tensors(bound), quantized.graph_signature.buffers_to_mutate.values())


def quantized_as_recorded(quantized: ExportedProgram, source: ExportedProgram) -> bool:
    """:func:`derivations_hold` of the ``quantized`` program and the ``source`` it was quantized
    from: what the quantize stage checks once, so that a retrain binds by the recorded recipes
    without reading or hashing last night's weights (:func:`stored_bindings`' ``checked``)."""
    from .quantize.graph import DERIVED_META

    return derivations_hold(_tensors(quantized), quantized.graph_module.meta.get(DERIVED_META) or {},
                            _tensors(source), quantized.graph_signature.buffers_to_mutate.values())


def requantized_tables(before: Mapping[str, torch.Tensor], entries: Mapping[str, dict],
                       old_tables: Mapping[str, torch.Tensor], new_tables: Mapping[str, torch.Tensor],
                       mutated: Any = (), checked: bool = False) -> dict[str, torch.Tensor] | None:
    """:func:`requantized_weights` on tables: ``before`` (the quantized program's constants),
    ``entries`` (its :data:`~lowering.quantize.graph.DERIVED_META`), the source's tables before
    (``old_tables``) and with the new weights (``new_tables``); ``mutated``: buffers left out.
    None unless :func:`derivations_hold` (``checked``: known to, not compared again)."""
    from .quantize.graph import derived_value

    if not checked and not derivations_hold(before, entries, old_tables, mutated):
        return None
    memo: dict = {}

    def value(target: str) -> torch.Tensor:
        if target not in memo:
            entry = entries.get(target)
            memo[target] = new_tables[target] if entry is None else \
                derived_value(entry["recipe"], value(entry["recipe"][1]), memo)
        return memo[target]

    mutated = set(mutated)
    out = {}
    for target, old in before.items():
        if target in mutated or not isinstance(old, torch.Tensor):
            continue
        if target not in entries and target not in new_tables:
            return None
        out[target] = value(target)
    return out


def derivations_hold(before: Mapping[str, torch.Tensor], entries: Mapping[str, dict],
                     old_tables: Mapping[str, torch.Tensor], mutated: Any = ()) -> bool:
    """Whether every weight of the quantized program (its tables ``before``) is what its
    :data:`~lowering.quantize.graph.DERIVED_META` entry (in ``entries``) records, computed from
    the source program's tables ``old_tables`` as recorded (digests chained to a source weight),
    or else that source weight itself: then a retrain's weights quantize by the entries alone.
    ``mutated``: buffers left out."""
    from .quantize.graph import value_digest

    def recorded(target: str) -> bool:
        """Whether ``target``'s recipe was computed from the source ``source`` holds (its digests chained)."""
        entry = entries[target]
        src = entry["recipe"][1]
        if src in entries:
            return entries[src]["value"] == entry["source"] and recorded(src)
        return src in old_tables and value_digest(old_tables[src]) == entry["source"]

    mutated = set(mutated)
    for target, old in before.items():
        if target in mutated or not isinstance(old, torch.Tensor):
            continue
        if target in entries:
            if value_digest(old) != entries[target]["value"] or not recorded(target):
                return False
        elif target not in old_tables or not _equal(old_tables[target], old):
            return False
    return True


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _check_same(pte: bytes, previous: bytes) -> None:
    if pte != previous:
        raise NotWeightsOnly("the program emitted with the new weights differs from the previous one "
                             "(something in it depends on weight values)")


def bind_source(program: ExportedProgram, state: Mapping[str, torch.Tensor]) -> ExportedProgram:
    """The exported (edge, fp32) ``program`` with its parameters and buffers taken from ``state``
    (by FQN) and its folded views of them computed again; a copy, ``program`` is untouched."""
    from .program import with_tables

    bound = with_tables(program)
    state_dict, constants = bound_tables(program.state_dict, program.constants, folded_views(program), state)
    bound.state_dict.update(state_dict)
    bound.constants.update(constants)
    return bound


def bound_tables(state_dict: Mapping[str, torch.Tensor], constants: Mapping[str, Any], views: Mapping[str, tuple],
                 state: Mapping[str, torch.Tensor]) -> tuple[dict, dict]:
    """:func:`bind_source` on a program's tables: ``(state_dict, constants)`` with every
    parameter and buffer from ``state``, every folded view (``views``: :func:`folded_views`)
    computed again from it, other constants as they are."""
    sources = {**{k: v for k, v in constants.items() if k not in views}, **state}
    bound_constants = dict(constants)
    for name, old in constants.items():
        if name in views:
            bound_constants[name] = _same_kind(name, old, {name: _fold(views[name], sources)})
        elif name in state:
            bound_constants[name] = _same_kind(name, old, state)
    return {name: _same_kind(name, old, state) for name, old in state_dict.items()}, bound_constants


def folded_views(program: ExportedProgram) -> dict[str, tuple]:
    """Each folded constant (export's view of a weight computed ahead of time) -> how to compute
    it from other weights: ``(op, args, kwargs)`` with ``("weight", target)`` for each weight, as
    export recorded it (:data:`lowering.export.folding.FOLDED_FROM`); one without that record
    raises NotWeightsOnly (a program read back from a store: lower again)."""
    from .export.folding import FOLDED_FROM

    recorded = {}
    specs = {s.arg.name: s for s in program.graph_signature.input_specs if hasattr(s.arg, "name")}
    for node in program.graph.nodes:
        if node.op == "placeholder" and FOLDED_FROM in node.meta and node.name in specs:
            recorded[specs[node.name].target] = node.meta[FOLDED_FROM]
    _check_views(program.constants, recorded)
    return recorded


def _check_views(constants: Mapping[str, Any], recorded: Mapping[str, tuple]) -> None:
    for name in constants:
        if "#" in name and name not in recorded:  # export's folded view (lowering.export.folding.folded_name)
            raise NotWeightsOnly(f"the folded constant {name!r} does not say which weight it is a view of "
                                 "(a program read back from a store): lower again")


def _is_weight(a: Any) -> bool:
    return isinstance(a, tuple) and len(a) == 2 and a[0] == "weight"


def _fold(recipe: tuple, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Compute a folded constant from its recipe (:func:`folded_views`) on the weights ``state``."""
    op_name, args, kwargs = recipe
    namespace, _, rest = op_name.partition("::")
    name, _, overload = rest.partition(".")
    op = getattr(getattr(getattr(torch.ops, namespace), name), overload or "default")

    def value(a):
        if not _is_weight(a):
            return a
        if a[1] not in state:
            raise NotWeightsOnly(f"the new weights have no {a[1]!r}: another architecture")
        return state[a[1]]

    args, kwargs = torch.utils._pytree.tree_map(value, (args, kwargs), is_leaf=_is_weight)
    with torch.no_grad():
        out = op(*args, **kwargs)
    weights = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
               if isinstance(t, torch.Tensor)}
    if out.is_contiguous() and out.untyped_storage().data_ptr() not in weights:
        return out  # a copy already (permute_copy): not a second one
    return out.clone(memory_format=torch.contiguous_format)  # a view of a weight: its own row-major copy


def rebound_program(program: ExportedProgram, bindings: Mapping[str, torch.Tensor]) -> ExportedProgram:
    """The delegated ``program`` with every constant (its own and each delegate's) taken from
    ``bindings`` by target, each delegate preprocessed again on its new weights; raises
    NotWeightsOnly if a delegate's payload changes (it holds something weight-dependent)."""
    from .control_flow_graph import has_control_flow
    from .lowered_module import LoweredBackendModule, preprocess
    from .program import with_tables

    if has_control_flow(program.graph):
        raise NotWeightsOnly("a program with control flow (cond / map) is lowered again")
    bound = with_tables(program)  # the graph is not rewritten: only tables and delegates change
    _swap(bound, bindings, "the program")
    for node in bound.graph.nodes:
        if node.op != "get_attr":
            continue
        lowered = getattr(bound.graph_module, node.target, None)
        if not isinstance(lowered, LoweredBackendModule):
            continue
        original = with_tables(lowered.original_module)
        _swap(original, bindings, f"delegate {node.target!r}")
        again = preprocess(original, lowered.backend_id, lowered.compile_specs, partition=node.target)
        if bytes(again.processed_bytes) != bytes(lowered.processed_bytes):
            raise NotWeightsOnly(f"delegate {node.target!r} ({lowered.backend_id}): its payload depends on "
                                 "weight values (e.g. per-tensor quantization parameters inline)")
        setattr(bound.graph_module, node.target, again)
    return bound


def with_partition_copies(bindings: Mapping[str, torch.Tensor], names: Any) -> Mapping[str, torch.Tensor]:
    """``bindings`` (target -> tensor) and, for each of ``names`` that is a partition's copy of a
    constant several partitions (or a partition and the program) share, the value of its original::

        {"lm_head.weight": w}, ["lm_head.weight_dup_XnnpackBackend_3"]
            -> {"lm_head.weight": w, "lm_head.weight_dup_XnnpackBackend_3": w}

    (:func:`lowering.partition.duplicate_shared_constants` names the copy ``<target>_dup_<tag>``
    after the exported program was stored: a tied embedding and LM head, say)."""
    copies = {}
    for name in names:
        base, dup, _ = name.rpartition("_dup_")
        while dup and name not in bindings and base not in bindings:  # a copy of a copy
            base, dup, _ = base.rpartition("_dup_")
        if dup and name not in bindings:
            copies[name] = bindings[base]
    return {**bindings, **copies} if copies else bindings


def _swap(program: ExportedProgram, bindings: Mapping[str, torch.Tensor], where: str) -> None:
    mutated = set(program.graph_signature.buffers_to_mutate.values())
    bindings = with_partition_copies(bindings, [*program.state_dict, *program.constants])
    for table in (program.state_dict, program.constants):
        for name, old in list(table.items()):
            if name in mutated or not isinstance(old, torch.Tensor):
                continue  # state (a KV cache): its initial value is the program's, not a weight
            if name not in bindings:
                raise NotWeightsOnly(f"{where}: no new value for {name!r}")
            table[name] = _same_kind(name, old, bindings)


def _same_kind(name: str, old: torch.Tensor, new: Mapping[str, torch.Tensor]) -> torch.Tensor:
    if name not in new:
        raise NotWeightsOnly(f"the new weights have no {name!r}: another architecture")
    tensor = new[name]
    if tuple(tensor.shape) != tuple(old.shape) or tensor.dtype != old.dtype:
        raise NotWeightsOnly(f"{name!r} is {tensor.dtype} {list(tensor.shape)} in the new weights, "
                             f"{old.dtype} {list(old.shape)} in the program: another architecture")
    if isinstance(old, torch.nn.Parameter):  # a program's parameters stay parameters
        return torch.nn.Parameter(tensor.detach(), requires_grad=old.requires_grad)
    return tensor.detach()


def _tensors(program: ExportedProgram) -> dict[str, torch.Tensor]:
    return {k: v for k, v in {**program.state_dict, **program.constants}.items() if isinstance(v, torch.Tensor)}
