"""One Prefect task per lowering stage, over the content-addressed artifact store.

Each stage is a thin wrapper: load its input artifacts, call one ``lowering``
function, store the output, return small JSON (ArtifactRefs + plain data) that
Prefect persists.  Cache keys are the stage, its version, the input digests and
the parameters (see :mod:`tasks.cache`), so a stage whose inputs did not change
is never recomputed, in any run or process.

    export ─► [quantize] ─► partition ─► create_submodule ─► build_programs ─► preprocess (per partition)
           ─► adjust ─► memory_plan ─► emit ─► verify          (portable: export ─► memory_plan ─► …)

A model of several methods runs export … memory_plan per method (each keyed on
its own program, so a method that did not change is never recomputed), then
one ``emit_methods`` over all of them (keyed on every method's name, program
and plan: adding, removing or renaming a method re-emits), then verify per method.

Inside one process the objects a stage stored are kept live (:data:`LIVE`), so
the next stage does not read back what was just written; a stage reads the
store only when its input came from a cache hit or another process.

Graph surgery that is cheap and deterministic (fusing a partition's nodes takes
milliseconds) is redone from the stored tagged program by the stages that need
the fused graph, rather than stored: ``create_submodule`` stores the plan of
which nodes form which submodule, and ``build_programs`` and ``adjust`` apply it.

Why one room: each stage's body is ``run_<stage>`` here, found by name (:class:`tasks.stage_tasks.StageTasks`)
beside its version and the inputs its key ignores; the bodies are thin, the work is lowering/'s.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import threading
import time
from typing import Any

import torch

from lowering.control_flow_graph import control_flow_nodes
from lowering.export import export as export_module, load as load_pt2
from lowering.export.folding import folded_recipes
from lowering.adjust import adjust_original_program, insert_lowered_module
from lowering.backend_ops import fused_ops_digest, fused_ops_of
from lowering.benchmark import READ_LIMIT, BenchmarkSettings, benchmark_pte, round_calls
from lowering.delegate import executorch_call_delegate
from lowering.emit.method import build_pte
from lowering.external import program_files
from lowering.lowered_module import LoweredBackendModule, preprocess
from lowering.memory_plan import MemoryPlan, memory_plan
from lowering.methods import build_methods_pte, mark_shared_state, mutated_buffers, plan_method_state
from lowering.partition import (
    CompileSpec,
    apply_partition_tags,
    external_weights_partitioner,
    partition,
    partition_tags_of,
)
from lowering.program import copy_program
from lowering.pte.flat_tensor import ptd_parts
from lowering.paging import page_out_module
from lowering.serialize import canonical_json
from lowering.submodule import create_submodules, getitems_of, nodes_by_tag
from lowering.subprogram import create_exported_program_from_submodule
from lowering.targets import partitioner_for
from lowering.to_backend import lower_control_flow_submodules, submodule_lowered_modules, to_backend
from lowering.verify import verify as verify_pte, verify_call_sequence, verify_quick
from lowering.verify_executorch import with_data

from .artifacts import (checkpoint_ranges, get_blob, get_doc, get_program, local_pte, put_blob, put_doc, put_pte,
                        put_program)
from .bind import bind_from_tables, bind_methods_from_tables, note_as_recorded, record_recipes
from .live import LIVE, release_live, take_program
from .model_spec import live_model
from .store import ArtifactRef, ArtifactStore

#: Bump a stage's version when its code changes what it produces.
STAGE_VERSIONS = {
    "export": "4",  # 2: ops the stock runtime lacks are decomposed (lowering.stock_ops); 3: inverse permutes cancel; 4: symbolic shapes take the fast path (other node names, same .pte)
    "quantize": "1",
    "partition": "5",  # 4: a shared constant's copy keeps shared_with_top_level in the store; 5: ExecuTorch's partitioners see a no-op clone as its _clone_dim_order (adapter.retarget_dim_order)
    "lower_control_flow": "1",
    "create_submodule": "2",
    "build_programs": "3",  # 3: as partition 4 (a tied LM head stored once when read back)
    "preprocess": "1",
    "adjust": "2",
    "memory_plan": "2",
    "emit": "1",
    "emit_methods": "2",  # 2: a KV cache every method writes before reading stores no initial value (issue 27)
    "bind_weights": "1",
    "bind_weights_methods": "1",
    "verify": "4",  # 4: a quantized program's tolerance grows with how far its nudged reference moves (issue 27)
    "verify_sequence": "3",  # 3: as verify 4
    "benchmark": "3",  # 3: the ratio by the thread's CPU time, files read per load, tiny rounds repeated, alone min_rounds
}


class InjectedFault(RuntimeError):
    """Raised by a stage named in :data:`FAULTS` (tests and the resume benchmark)."""


#: Stage names that fail on purpose, e.g. ``FAULTS.add("emit")``.
FAULTS: set[str] = set()
#: How many times each stage body ran in this process (cache hits do not count).
EXECUTIONS: collections.Counter[str] = collections.Counter()
_lock = threading.Lock()


def _specs_json(specs) -> list[dict[str, str]]:
    return [{"key": s.key, "value": s.value.hex()} for s in specs]


def _specs(doc: list[dict[str, str]]) -> list[CompileSpec]:
    return [CompileSpec(s["key"], bytes.fromhex(s["value"])) for s in doc]


def _begin(stage: str) -> None:
    with _lock:
        EXECUTIONS[stage] += 1
    if stage in FAULTS:
        raise InjectedFault(f"stage {stage!r} failed on purpose (lowerflow fault injection)")


# --------------------------------------------------------------------------- stage bodies


def run_export(store: ArtifactStore, model: str, fingerprint: str, options: dict,
               external_weights: bool | None = None, keep_for: dict | None = None) -> dict:
    """Stage 1.  Keyed on the model's ``fingerprint`` (weights, code, inputs, options;
    see :mod:`tasks.fingerprint`), never on where its file lives.  ``external_weights``
    (in the key only when given): ``fingerprint`` is the model's structure digest (its
    weights by name and layout, not bytes: :mod:`flows.weights_only`), and the result also
    holds ``weights``, the digest of the weights this program holds, and ``folded``, how
    export folded views of them (what :func:`run_bind_weights` binds new weights with).
    ``keep_for`` (:func:`lowering.targets.keep_for`; in the key only when given): one
    target's own export, the ops its partitioner keeps left whole, its ``fold_constants``."""
    _begin("export")
    own = partitioner_for(keep_for["target"], keep_for["options"]) if keep_for else None
    keep, fold = (own.ops_to_not_decompose, own.fold_constants) if own is not None else (None, None)
    loaded = live_model(model, fingerprint, options)
    if loaded.pt2 is not None:
        program = load_pt2(loaded.pt2, name=model, trust_pickle=loaded.trust_pickle, keep=keep, fold_constants=fold)
    else:
        label = model if loaded.method is None else f"{model} method {loaded.method}"
        program = export_module(loaded.module, loaded.inputs, dynamic_shapes=loaded.dynamic_shapes, name=label,
                                strict=loaded.strict, keep=keep, fold_constants=fold)
        page_out_module(loaded.module)  # weights mapped from a checkpoint: not read again until verify
    # The buffers it mutates: a model of several methods must not share them (lowering.methods).
    # An hf: checkpoint's weights are kept as ranges of its files, not stored again (tasks/store.py, "windows"):
    # a new checkpoint is a new key.  Not with external_weights: keyed on the structure, this program keeps
    # the weights it was exported with (what bind_weights compares tonight's with) after the checkpoint changes.
    files = None if external_weights else checkpoint_ranges(model)
    result = {"program": put_program(store, program, files=files), "mutated_buffers": mutated_buffers(program)}
    if external_weights:
        result["weights"] = loaded.fingerprint.parts.get("weights")
        result["folded"] = put_doc(store, folded_recipes(program), "folded")
    return result


def run_bind_weights(store: ArtifactStore, exported: dict, program: ArtifactRef, plan: ArtifactRef, emitted: dict,
                     weights: str, model: str, fingerprint: str, options: dict | None = None,
                     recipe: dict | None = None, reference: ArtifactRef | None = None,
                     derived: ArtifactRef | None = None, runtime_ops: list[str] | None = None,
                     references: bool = True) -> dict:
    """The weights of a program lowered with external weights (:mod:`flows.weights_only`):
    the ``.ptd`` of the model whose weights digest is ``weights``, bound to the program the
    graph stages made from ``exported`` (stage export's result, keyed on the model's structure),
    ``program`` (delegated), ``plan`` and ``emitted`` (``{"pte", "ptd"}``).

    The weights ``exported`` holds: emit's ``.ptd`` and the quantize stage's ``reference``
    as they are.  Other weights: :func:`lowering.rebind.rebind_weights` (quantized again with
    ``recipe``, every delegate preprocessed again, the ``.pte`` emitted again and checked
    byte-identical), or, where the stored tables suffice, :func:`tasks.bind.bind_from_tables`;
    ``"reference"``: the quantized program with them (verify's; None unless ``references``,
    false when verify does not run).  ``derived``:
    how the quantize stage computed its constants (then only the weights are quantized again).  When they
    cannot be bound (:class:`~lowering.rebind.NotWeightsOnly`), ``{"fallback": why}``: the flow
    lowers the model again keyed on its weights.  ``model``, ``fingerprint`` (the model's),
    ``options``: only find the model again, not in the key."""
    from lowering.export.folding import restore_folded
    from lowering.lower import LowerResult
    from lowering.rebind import NotWeightsOnly, rebind_weights

    _begin("bind_weights")
    if weights == exported.get("weights"):
        return {"ptd": emitted["ptd"], "reference": reference, "rebound": False}
    start = time.perf_counter()
    loaded = live_model(model, fingerprint, options)
    done = bind_from_tables(store, exported, program, get_memory_plan(store, plan), emitted, loaded.module,
                            recipe, reference, derived, runtime_ops, references=references)
    if done is not None:  # else the quantize pass must run again: on the programs
        return {**done, "seconds": round(time.perf_counter() - start, 4)} if "ptd" in done else done
    # (what the store does not keep in a program: how export folded views, how quantize derived constants;
    # set on the programs themselves, true of them wherever they are read; rebind copies what it changes)
    source = get_program(store, exported["program"])
    restore_folded(source, get_doc(store, exported["folded"]))
    quantized = None
    if reference is not None and derived is not None:
        from lowering.quantize.graph import DERIVED_META

        quantized = get_program(store, reference)
        quantized.graph_module.meta[DERIVED_META] = get_doc(store, derived)
    previous = LowerResult(pte=store.get_bytes(emitted["pte"]), memory_plan=get_memory_plan(store, plan),
                           exported_program=get_program(store, program), ptd=b"", source_program=source,
                           quantized_program=quantized)
    try:
        bound = rebind_weights(previous, loaded.module, quantize=recipe, runtime_ops=runtime_ops)
    except NotWeightsOnly as exc:
        return {"fallback": str(exc)}
    result = {"ptd": store.put_bytes(bound.ptd, "ptd"), "reference": None, "rebound": True,
              # a recipe's weights: quantized by the quantize stage's recorded recipes, or by its pass again
              **({"quantized": "weights" if "quantize_weights" in bound.timings else "pass"} if recipe else {})}
    if bound.quantized_program is not None and references:  # verify's (stored only when verify runs)
        result["reference"] = put_program(store, bound.quantized_program)
    result["seconds"] = round(time.perf_counter() - start, 4)
    return result


def run_bind_weights_methods(store: ArtifactStore, exported: dict, methods: dict, emitted: dict, weights: dict,
                             model: str, fingerprints: dict, options: dict | None = None,
                             constants: dict | None = None, recipe: dict | None = None,
                             quantized: dict | None = None, derived: dict | None = None,
                             runtime_ops: list[str] | None = None, references: bool = True) -> dict:
    """:func:`run_bind_weights` of a model of several methods (one ``.pte``, one ``.ptd``):
    ``exported``, ``methods`` (``{"program", "plan"}``), ``weights``, ``quantized`` (the
    quantize stage's programs) and ``derived``: per method; ``constants``: the constant
    methods emit_methods wrote.  Returns ``{"ptd", "references": {method: ref} or None,
    "rebound"}`` or ``{"fallback": why}``.  ``model``, ``fingerprints`` (each method's),
    ``options``: only find the methods again, not in the key."""
    from lowering.export.folding import restore_folded
    from lowering.lower import MethodsLowerResult
    from lowering.quantize.graph import DERIVED_META
    from lowering.rebind import NotWeightsOnly, rebind_weights

    _begin("bind_weights_methods")
    if all(weights[m] == exported[m].get("weights") for m in exported):
        return {"ptd": emitted["ptd"], "references": quantized, "rebound": False}
    start = time.perf_counter()
    modules = {m: live_model(model, fingerprints[m], options).module for m in exported}
    plans = {m: get_memory_plan(store, e["plan"]) for m, e in methods.items()}
    done = bind_methods_from_tables(store, exported, methods, plans, emitted, modules, constants, recipe,
                                    quantized, derived, runtime_ops, references=references)
    if done is not None:  # else the quantize pass must run again: on the programs
        return {**done, "seconds": round(time.perf_counter() - start, 4)} if "ptd" in done else done
    sources, before = {}, {}
    for method, done in exported.items():
        sources[method] = get_program(store, done["program"])
        restore_folded(sources[method], get_doc(store, done["folded"]))
        if quantized and derived and derived.get(method) is not None:
            before[method] = get_program(store, quantized[method])
            before[method].graph_module.meta[DERIVED_META] = get_doc(store, derived[method])
    previous = MethodsLowerResult(
        pte=store.get_bytes(emitted["pte"]), ptd=b"", source_programs=sources, constant_methods=dict(constants or {}),
        memory_plans={m: get_memory_plan(store, e["plan"]) for m, e in methods.items()},
        exported_programs={m: get_program(store, e["program"]) for m, e in methods.items()},
        quantized_programs=before or None)
    try:
        bound = rebind_weights(previous, modules, quantize=recipe, runtime_ops=runtime_ops)
    except NotWeightsOnly as exc:
        return {"fallback": str(exc)}
    result = {"ptd": store.put_bytes(bound.ptd, "ptd"), "references": None, "rebound": True,
              **({"quantized": "weights" if all("quantize_weights" in t for t in bound.timings.values())
                  else "pass"} if recipe else {})}
    if bound.quantized_programs and references:  # verify's (stored only when verify runs)
        result["references"] = {m: put_program(store, p) for m, p in bound.quantized_programs.items()}
    result["seconds"] = round(time.perf_counter() - start, 4)
    return result


def run_quantize(store: ArtifactStore, program: ArtifactRef, recipe: dict, calibration: str | None,
                 versions: dict, source: str | None = None, model: str | None = None,
                 fingerprint: str | None = None, options: dict | None = None,
                 backend: dict | None = None) -> dict:
    """Quantize the exported ``program`` with ``recipe`` (its mapping form).

    Keyed on the program's digest, the recipe, ``calibration`` (the digest of the
    calibration batches, None for a recipe that needs none) and ``versions`` (of the
    libraries that decide the result: :func:`quantize_versions`).  ``source``, ``model``
    and ``fingerprint`` only find the batches again in another process
    (:func:`tasks.calibration.calibration_batches`): not in the key.  ``backend``
    (:func:`lowering.targets.quantizer_for`; in the key only when given): the target's
    backend quantizes with its own PT2E quantizer (Ethos-U: Arm's), on the live model
    before decomposition, as :func:`lowering.lower` does; ``program`` then keys the model.
    """
    from lowering.quantize import parse_recipe, quantize
    from lowering.quantize.graph import DERIVED_META
    from lowering.rebind import quantized_as_recorded

    from .calibration import calibration_batches

    _begin("quantize")
    batches = calibration_batches(calibration, source, model, fingerprint, options) if calibration else None
    fp32 = get_program(store, program)
    if backend is not None:
        quantized = quantize_live_model(backend, recipe, batches, model, fingerprint, options)
    else:
        quantized = quantize(fp32, parse_recipe(recipe), calibration=batches)
    weights = {"fp32": weight_bytes(fp32), "quantized": weight_bytes(quantized)}
    # how the pass computed each constant from a weight: a retrain's weights quantize without it (bind_weights)
    derived = quantized.graph_module.meta.get(DERIVED_META, {})
    as_recorded = bool(derived) and backend is None and quantized_as_recorded(quantized, fp32)
    # The stages after this one read the quantized program: the fp32 one's folded weights need
    # not stay live through them (SmolLM2-135M 8da4w: 0.5 GB); another target reads it back.
    del fp32
    LIVE.drop(program)
    result = {"program": put_program(store, quantized), "quantized_nodes": count_quantized_nodes(quantized),
              "weight_bytes": weights, "derived": put_doc(store, derived, "derived_constants")}
    if as_recorded:  # checked once here, on the live programs: a retrain's bind need not read the weights back
        note_as_recorded(store, program, result["program"], result["derived"])
    return result


def quantize_live_model(backend: dict, recipe: dict, batches, model: str, fingerprint: str, options: dict | None):
    """The live model quantized by ``backend["target"]``'s own quantizer (:func:`run_quantize`)."""
    from lowering.quantize import parse_recipe, quantize_module

    partitioner = partitioner_for(backend["target"], backend["options"])
    loaded = live_model(model, fingerprint, options)
    if loaded.module is None or loaded.dynamic_shapes is not None:
        raise ValueError(f"model {model!r}: target {backend['target']!r} quantizes with its backend's own quantizer, "
                         "which takes a module with static shapes (not a .pt2 program, not dynamic_shapes)")
    recipe = parse_recipe(recipe)
    return quantize_module(loaded.module, loaded.inputs, recipe, batches, partitioner.quantizer(recipe),
                           name=model, keep=partitioner.ops_to_not_decompose)


def weight_bytes(program: torch.export.ExportedProgram) -> int:
    """Bytes of the program's parameters, buffers and lifted constants (each tensor once)."""
    seen, total = set(), 0
    for tensor in [*program.state_dict.values(), *program.constants.values()]:
        if isinstance(tensor, torch.Tensor) and id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def quantize_versions() -> dict[str, str]:
    """The versions of the libraries whose code decides a quantized program (torch's and
    lowerflow's own source are in every key already)."""
    import importlib.metadata

    return {"torchao": importlib.metadata.version("torchao")}


def count_quantized_nodes(program: torch.export.ExportedProgram) -> int:
    """Quantize / dequantize / choose-qparams nodes of the program (what the report shows)."""
    from lowering.quant_ops import QUANT_NAMESPACES

    return sum(1 for n in program.graph.nodes if n.op == "call_function"
               and getattr(n.target, "namespace", None) in QUANT_NAMESPACES)


def fused_ops_key(target: str, options: dict) -> str | None:
    """The digest of the fused ops ``target``'s partitioner applies ("" for none): the
    ``fused_ops`` parameter of stage 2, so its cache key changes with a declaration
    (op schema, pattern, replacement, filters), wherever the backend's code lives.
    Nothing is traced: it costs microseconds.

    None when the partitioner or its fused ops are unusable: stage 2 then fails
    with that error itself (a failed stage is never cached).
    """
    try:
        partitioner = partitioner_for(target, options)
        return fused_ops_digest(fused_ops_of(partitioner)) if partitioner is not None else ""
    except Exception:
        return None


def run_partition(
    store: ArtifactStore, program: ArtifactRef, target: str, options: dict, fused_ops: str | None = None,
    shared_state: list[str] | None = None, external_weights: bool | None = None,
) -> dict:
    """Stage 2: the tagged program and its tags (node name -> tag), stored apart.

    ``fused_ops`` is :func:`fused_ops_key` of the target, computed by the caller
    (it is part of the cache key); a stale value is an error, never a wrong hit.
    ``shared_state``: buffers another method writes, never constant data here
    (in the key only when given).  ``external_weights``: every partition asks its backend for
    external weights (:func:`lowering.partition.external_weights_partitioner`; in the key only
    when given).
    """
    _begin("partition")
    partitioner = external_weights_partitioner(partitioner_for(target, options), bool(external_weights))
    if fused_ops is not None and fused_ops != fused_ops_digest(fused_ops_of(partitioner)):
        raise RuntimeError(
            f"target {target!r}: the fused ops of its partitioner changed while the flow ran "
            "(fused_ops digest differs); lower again"
        )
    exported = get_program(store, program)
    if shared_state:
        mark_shared_state(exported, shared_state)
    result = partition(exported, partitioner)
    tagged = result.tagged_exported_program
    doc = {
        "tags": partition_tags_of(tagged.graph),
        "partitions": {
            tag: {"backend_id": spec.backend_id, "compile_specs": _specs_json(spec.compile_specs)}
            for tag, spec in result.partition_tags.items()
        },
    }
    tagged_ref = put_program(store, tagged)
    return {
        "program": tagged_ref,
        "tagged": {"program": tagged_ref, "tags": put_doc(store, doc, "partition_tags")},
        "partitions": sorted(doc["partitions"]),
        "total_nodes": count_call_nodes(tagged),
        # cond / map nodes: their branches and bodies are partitioned by lower_control_flow.
        "control_flow": len(control_flow_nodes(tagged.graph)),
    }


def _tagged_program(store: ArtifactStore, tagged: dict):
    """A private copy of the stage-2 program with its tags applied (safe to fuse).

    The copy is the same graph whether the program is this process's live
    object or was read back from the store (:func:`lowering.serialize.deserialize_program`
    restores the stored nodes), so fusing it gives the same plan either way.
    """
    program = copy_program(get_program(store, tagged["program"]))
    doc = get_doc(store, tagged["tags"])
    apply_partition_tags(program.graph, doc["tags"])
    return program, doc


def _fuse(program, doc: dict) -> tuple[dict, dict]:
    """Fuse every tag of ``doc`` (in place): ({tag: call node}, the plan of what was fused).

    The plan records, per tag, the submodule, its nodes, the top-level values it
    takes and the getitems that carry its outputs: all of it is a function of
    the stored tagged program and tags (fusion order: ``sorted`` tags).
    """
    members = nodes_by_tag(program.graph, sorted(doc["partitions"]))
    calls = create_submodules(program.graph_module, doc["partitions"])
    plan = {
        tag: {
            "module": call.target,
            "nodes": [n.name for n in members[tag]],
            "inputs": [a.name for a in call.args],
            "outputs": [u.name for u in getitems_of(call)],
        }
        for tag, call in calls.items()
    }
    return calls, plan


def run_create_submodule(store: ArtifactStore, tagged: dict) -> dict:
    """Stage 3: fuse each tag into a submodule (checks cycles) and store the plan."""
    _begin("create_submodule")
    program, doc = _tagged_program(store, tagged)
    _, plan = _fuse(program, doc)
    return {"plan": put_doc(store, plan, "submodule_plan")}


def _fused(store: ArtifactStore, tagged: dict, plan_ref: ArtifactRef):
    """Re-apply the stage-3 plan to the tagged program: (program, {tag: call node}, tag doc).

    Fusing is cheap and deterministic, so stages 4 and 6 redo it rather than
    store the fused graph; the stored plan proves they fused what stage 3 did.
    """
    program, doc = _tagged_program(store, tagged)
    calls, plan = _fuse(program, doc)
    check_plan(get_doc(store, plan_ref), plan, tagged)
    return program, calls, doc


def check_plan(stored: dict, fused: dict, tagged: dict) -> None:
    """Raise, naming the partition and what differs, unless ``fused`` is the ``stored`` plan."""
    if stored == fused:
        return
    where = f"tagged program {tagged['program'].sha256[:12]}, tags {tagged['tags'].sha256[:12]}"
    if set(stored) != set(fused):
        raise RuntimeError(
            f"fusing the stored partitions again gives tags {sorted(fused)}, the stored plan has "
            f"{sorted(stored)} ({where})"
        )
    for tag in sorted(stored):
        for field in ("module", "nodes", "inputs", "outputs"):
            was, now = stored[tag].get(field), fused[tag].get(field)
            if was != now:
                raise RuntimeError(
                    f"partition {tag!r}: fusing again does not reproduce the stored plan: {field} "
                    f"{_short(now)}, stage create_submodule recorded {_short(was)} ({where})"
                )


def _short(value: Any, limit: int = 6) -> str:
    """A list shown with at most ``limit`` items (plans of big partitions are long)."""
    if isinstance(value, list) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} items)"
    return repr(value)


def run_build_programs(store: ArtifactStore, tagged: dict, plan: ArtifactRef) -> dict:
    """Stage 4: each partition's own ExportedProgram."""
    _begin("build_programs")
    program, calls, doc = _fused(store, tagged, plan)
    partitions = []
    for tag, call in calls.items():
        sub_program, _ = create_exported_program_from_submodule(program, call, tag)
        spec = doc["partitions"][tag]
        partitions.append({"tag": tag, "program": put_program(store, sub_program), **spec})
    return {"partitions": partitions}


def run_preprocess(
    store: ArtifactStore, program: ArtifactRef, backend_id: str, compile_specs: list, label: str,
    versions: dict | None = None,
) -> dict:
    """Stage 5, one partition.  ``label`` names it in errors and is not in the cache key,
    so identical partitions of different models share one cache entry.  ``versions``: of
    executorch and the vendor compiler of a plugin backend (:func:`lowering.targets.backend_versions`;
    in the key only when given: a new coremltools recompiles, lowerflow's own backends keep their keys).
    ``compile_seconds``: how long the backend's compile took (what a cache hit saved)."""
    _begin("preprocess")
    start = time.perf_counter()
    lowered = preprocess(get_program(store, program), backend_id, _specs(compile_specs), partition=label)
    seconds = time.perf_counter() - start
    processed = store.put_bytes(lowered.processed_bytes, "processed")
    result = {"processed": processed, "backend_id": lowered.backend_id, "compile_seconds": round(seconds, 4)}
    if lowered.named_data:  # weights the payload refers to by key, one stored blob each
        result["named_data"] = [{"key": key, "blob": put_blob(store, blob)} for key, blob in lowered.named_data.items()]
    return result


def run_adjust(store: ArtifactStore, tagged: dict, plan: ArtifactRef, partitions: list) -> dict:
    """Stage 6: swap each submodule for its lowered module; the delegated program."""
    _begin("adjust")
    program, calls, _ = _fused(store, tagged, plan)
    by_tag = {p["tag"]: p for p in partitions}
    delegated_nodes = 0
    for tag, call in calls.items():
        part = by_tag[tag]
        _, io = create_exported_program_from_submodule(program, call, tag)
        original = get_program(store, part["program"])
        delegated_nodes += sum(1 for n in original.graph.nodes if n.op == "call_function")
        lowered = LoweredBackendModule(
            original, part["backend_id"], store.get_bytes(part["processed"]), _specs(part["compile_specs"]),
            {entry["key"]: get_blob(store, entry["blob"]) for entry in part.get("named_data", [])},
        )
        insert_lowered_module(program, call, lowered, io)
    delegated = adjust_original_program(program)
    return {"program": put_program(store, delegated), "delegated_nodes": delegated_nodes}


def run_lower_control_flow(store: ArtifactStore, program: ArtifactRef, target: str, options: dict,
                           external_weights: bool | None = None) -> dict:
    """Stages 2-6 inside every cond branch and map body of the (top-level delegated) program.

    The target's partitioner runs on each branch / body as a program of its own
    whose inputs are all user inputs (a branch's weights arrive as operands),
    and the delegated branch replaces it.  Keyed on the program's digest, the
    target and its options: everything that decides the result.
    """
    _begin("lower_control_flow")
    delegated = copy_program(get_program(store, program))
    partitioner = external_weights_partitioner(partitioner_for(target, options), bool(external_weights))
    lower_control_flow_submodules(delegated, lambda sub: to_backend(sub, partitioner))
    lowered = submodule_lowered_modules(delegated.graph_module)
    return {
        "program": put_program(store, delegated),
        "partitions": len(lowered),
        "delegated_nodes": sum(
            1 for module in lowered for n in module.original_module.graph.nodes if n.op == "call_function"
        ),
    }


def run_memory_plan(store: ArtifactStore, program: ArtifactRef, state_of: dict | None = None) -> dict:
    """Stage 7.  ``state_of``: for one method of several with mutable buffers,
    ``{"method": name, "programs": {method: program ref}, "share": bool}`` (where
    its state lives depends on every method's program, so the key covers them all;
    lowering.methods.plan_method_state)."""
    _begin("memory_plan")
    shared = None
    if state_of:
        programs = {m: get_program(store, ref) for m, ref in state_of["programs"].items()}
        states = plan_method_state(programs, share=bool(state_of["share"]))
        shared = states[state_of["method"]] if states else None
    plan = memory_plan(get_program(store, program), shared_state=shared)
    ref = store.put_bytes(canonical_json(plan.to_dict()), "memory_plan")
    LIVE.put(ref, plan)
    result = {
        "plan": ref,
        "arena_bytes": int(sum(plan.arena_sizes)),
        "lower_bound": int(plan.lower_bound),
        "algorithm": plan.algorithm,
    }
    if shared is not None:
        result["shared_state_bytes"] = int(shared.size)  # counted once over the methods
    return result


def get_memory_plan(store: ArtifactStore, ref: ArtifactRef) -> MemoryPlan:
    import json

    return LIVE.get(ref, lambda: MemoryPlan.from_dict(json.loads(store.get_bytes(ref))))


def run_emit(store: ArtifactStore, program: ArtifactRef, plan: ArtifactRef,
             runtime_ops: list[str] | None = None, external_weights: bool | None = None) -> dict:
    """Stage 8: the .pte bytes.  ``runtime_ops``: the runtime profile every operator must
    be in (:func:`lowering.stock_ops.runtime_profile`; None: the default, and the key
    leaves it out: :data:`STAGE_OPTIONAL`).  ``external_weights``: the weights go to a
    ``.ptd`` (``"ptd"`` in the result; :mod:`lowering.external`)."""
    _begin("emit")
    delegated, memory_plan = get_program(store, program), get_memory_plan(store, plan)
    return _emitted(store, build_pte(delegated, memory_plan, runtime_ops=runtime_ops,
                                     external_weights=bool(external_weights)),
                    bool(external_weights), {None: (delegated, memory_plan)}, None, runtime_ops)


def _emitted(store: ArtifactStore, built: Any, external_weights: bool, methods: dict, constants: dict | None,
             runtime_ops: list[str] | None) -> dict:
    """Store an emitted program ``built`` (the ``PteData``, passed straight from the emitter so that
    nothing else holds it) as its files (:func:`lowering.external.program_files`): ``{"pte": ref}``,
    and with ``external_weights`` ``"ptd"`` and ``"recipes"``, how a retrain's ``.ptd`` is written
    (:func:`tasks.bind.record_recipes`; ``methods``: ``{name: (delegated program, plan)}``, None as
    the name of a program of one).  The recipes' check emits the program once more, so the first
    emit is let go before: all but the entries the ``.ptd`` was written from (views of the weights
    and of the delegates' named data, which the program holds anyway); the ``.ptd`` is stored from
    them piece by piece (:func:`lowering.pte.flat_tensor.ptd_parts`), never joined."""
    pte = program_files(built, False)[0]
    entries, built = built.external if external_weights else None, None
    result = {"pte": put_pte(store, pte)}
    if entries is not None:  # the .ptd written piece by piece (views of the weights): never joined in memory
        result["ptd"] = store.put_parts(ptd_parts(entries), "ptd")
        result.update(record_recipes(store, methods, pte, entries, constants, runtime_ops))
    return result


def run_emit_methods(store: ArtifactStore, methods: dict, constants: dict | None = None,
                     runtime_ops: list[str] | None = None, external_weights: bool | None = None) -> dict:
    """Stage 8 of a model of several methods: ONE .pte holding every method.

    ``methods``: ``{name: {"program": ref, "plan": ref}}`` (the key covers the
    method set: names, programs and plans).  Methods are written in name order;
    shared weights and equal delegate payloads are stored once (lowering.methods).
    ``constants``: the constant methods ``{name: value}`` (an hf: model's metadata).
    ``runtime_ops``, ``external_weights``: as :func:`run_emit`'s (one ``.ptd`` for every method).
    """
    _begin("emit_methods")
    programs = {name: (get_program(store, entry["program"]), get_memory_plan(store, entry["plan"]))
                for name, entry in methods.items()}
    return _emitted(store, build_methods_pte(programs, constants, runtime_ops=runtime_ops,
                                             external_weights=bool(external_weights)),
                    bool(external_weights), programs, constants, runtime_ops)


def run_verify(store: ArtifactStore, pte: ArtifactRef, model: str, fingerprint: str, method: str = "forward",
               reference: ArtifactRef | None = None, min_sqnr: float | None = None,
               max_error: float | None = None, options: dict | None = None, mode: str | None = None,
               ptd: ArtifactRef | None = None, tolerance: float | None = None) -> dict:
    """Run the .pte's ``method`` (our executor; ExecuTorch's runtime too when installed)
    against eager.  ``fingerprint`` is the model's, or for a model of several methods
    that method's own.  A quantized program is compared with its ``reference`` (the
    quantized program, run in torch), and its error against fp32 eager is reported and
    held to ``min_sqnr`` / ``max_error`` (lowering.verify).  ``options``: what the model was
    loaded with (its ``version`` and ``dynamic_shapes``), to load it again in another process.
    ``mode``: None runs the full check (lowering.verify.verify), ``"quick"`` the quick one
    (lowering.verify.verify_quick; in the key only when given: :data:`STAGE_OPTIONAL`).
    The runtimes read the program from the store's file where the store is a local directory.
    ``ptd``: the program's external weights; both runtimes run the pair, checked first
    (:func:`lowering.external.check_pair`; in the key only when given).
    ``tolerance``: atol and rtol of a reduced-precision backend (:func:`lowering.targets.verify_tolerance`;
    None: the fp32 default, and the key leaves it out)."""
    _begin("verify")
    if mode not in (None, "quick"):
        raise ValueError(f"verify mode {mode!r}: the stage runs None (full) or 'quick'")
    release_live(keep=reference)
    loaded = live_model(model, fingerprint, options)
    if loaded.pt2 is not None:
        return {"ok": None, "checks": [], "skipped": "a .pt2 model has no eager module to compare with"}
    thresholds = {} if reference is None else {"min_sqnr": min_sqnr, "max_error": max_error}
    program = _program_file(store, pte, ptd)
    tolerances = {"atol": tolerance, "rtol": tolerance} if tolerance is not None else {}
    check = verify_quick if mode == "quick" else functools.partial(verify_pte, dynamic_shapes=loaded.dynamic_shapes)
    # The quantized reference is read here for the check alone (not kept live): it drops it once run.
    report = check(program, loaded.module, loaded.inputs, method=method,
                   reference=None if reference is None else take_program(store, reference), **thresholds, **tolerances)
    return {**report.to_dict(), **({"mode": mode} if mode else {})}


def run_verify_sequence(store: ArtifactStore, pte: ArtifactRef, model: str, fingerprint: str,
                        options: dict | None = None, references: dict | None = None,
                        ptd: ArtifactRef | None = None) -> dict:
    """The check of state shared across methods: every method in program order, twice,
    on one loaded program against the eager modules (sharing their state) run the
    same way (lowering.verify.verify_call_sequence).  ``fingerprint``: the model's.
    ``references``: a quantized program's ``{method: quantized program ref}``, run in torch
    (sharing their state) as what the program must match (in the key only when given)."""
    _begin("verify_sequence")
    release_live()
    loaded = live_model(model, fingerprint, options)
    methods = {name: (sub.module, sub.inputs) for name, sub in (loaded.methods or {}).items()}
    quantized = {m: get_program(store, ref) for m, ref in references.items()} if references else None
    return verify_call_sequence(_program_file(store, pte, ptd), methods, references=quantized).to_dict()


def _program_file(store: ArtifactStore, pte: ArtifactRef, ptd: ArtifactRef | None):
    """The program for verify: the store's file where it is local (else its bytes), with its
    ``.ptd`` (:func:`lowering.verify_executorch.with_data`) when its weights are external."""
    program = store.local_object_path(pte) or store.get_bytes(pte)
    if ptd is None:
        return program
    return with_data(program, store.local_object_path(ptd) or store.get_bytes(ptd))


def run_benchmark(store: ArtifactStore, pte: ArtifactRef, model: str, fingerprint: str, settings: dict,
                  host: dict, previous: ArtifactRef | None = None, options: dict | None = None,
                  method: str = "forward", ptd: ArtifactRef | None = None,
                  previous_ptd: ArtifactRef | None = None) -> dict:
    """Time the .pte on ExecuTorch's runtime of this host (lowering.benchmark): load time,
    latency median / p90, a decoder's prefill and decode tokens/s.  ``previous``: last
    night's published program of the same model and target (in the key only when given):
    both run interleaved in this process and the report has the ratios new/old.
    ``ptd`` / ``previous_ptd``: their external weights, loaded with them (in the key only when given).
    ``host`` (this machine's CPU and threads) is in the key: figures are the host's."""
    _begin("benchmark")
    if pte.size > READ_LIMIT:  # a big program (an LLM): its memory first; else verify, just before, let go
        release_live()  # (its gc.collect is ~1.3 s of a loaded machine: the whole stage of a small program)
    loaded, bench = live_model(model, fingerprint, options), BenchmarkSettings(**settings)
    if loaded.pt2 is not None or loaded.module is None:
        return {"skipped": "a .pt2 model has no eager module to take inputs from"}
    calls, prefill_calls = round_calls(loaded.module, loaded.inputs, bench, method)
    with contextlib.ExitStack() as files:
        path, old, data, old_data = (None if ref is None else local_pte(store, ref, files)
                                     for ref in (pte, previous, ptd, previous_ptd))
        return benchmark_pte(path, [method], calls, bench, previous=old, prefill_calls=prefill_calls,
                             data=data, previous_data=old_data)


# --------------------------------------------------------------------------- cache keys


#: The stages (each one's body is ``run_<stage>``) and the inputs each one's cache key ignores.
STAGE_IGNORES: dict[str, tuple[str, ...]] = {
    # ``model`` (a resolved path) only finds the model again: its fingerprint is what decides
    # the output, so a checkout elsewhere (another machine) shares the keys.
    "export": ("model",), "quantize": ("source", "model", "fingerprint", "options"), "partition": (),
    "create_submodule": (), "build_programs": (), "preprocess": ("label",), "adjust": (),
    "lower_control_flow": (), "memory_plan": (), "emit": (), "emit_methods": (),
    "bind_weights": ("model", "fingerprint", "options"),
    "bind_weights_methods": ("model", "fingerprints", "options"),
    "verify": ("model", "options"), "verify_sequence": ("model", "options"),
    "benchmark": ("model", "options"),
}
#: Inputs a stage's key leaves out while they are None (their default): added after the
#: stage's keys were in use, so a run that does not set them keeps those keys.
STAGE_OPTIONAL: dict[str, tuple[str, ...]] = {
    "export": ("external_weights", "keep_for"),
    "emit": ("runtime_ops", "external_weights"), "emit_methods": ("runtime_ops", "external_weights"),
    "partition": ("shared_state", "external_weights"), "lower_control_flow": ("external_weights",),
    "verify": ("mode", "ptd", "tolerance"), "preprocess": ("versions",), "quantize": ("backend",),
    "verify_sequence": ("references", "ptd"),
    "benchmark": ("previous", "ptd", "previous_ptd"),
}


def stage_inputs(stage: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """``inputs`` with the defaults of ``run_<stage>``'s parameters filled in: what Prefect
    hands the cache policy (it binds a task's call with its defaults), so a key computed
    here (a dry run's lookup, a record's key) is the task's own."""
    body = globals().get(f"run_{stage}")
    if body is None:
        return inputs
    parameters = list(inspect.signature(body).parameters.values())[1:]  # less the store
    return {**{p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}, **inputs}


def count_call_nodes(program: torch.export.ExportedProgram) -> int:
    return sum(
        1 for n in program.graph.nodes if n.op == "call_function" and n.target is not executorch_call_delegate
    )
