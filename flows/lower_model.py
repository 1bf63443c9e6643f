"""The per-model flow: the lowering DAG of one model for one or more targets.

    export ──┬─► memory_plan ─► emit ─► verify                                   (portable)
             └─► partition ─► create_submodule ─► build_programs ─► preprocess×N
                           ─► adjust ─► memory_plan ─► emit ─► verify          (a backend target)

Every stage is a cached task (tasks.stages), so a re-run executes only stages
whose inputs changed, and a run that failed resumes at the stage that failed.
Outputs, at predictable names in the store: ``outputs/<name>/<target>.pte`` and
``outputs/<name>/manifest.json`` (what was produced, stage by stage).

A model of several methods (a factory returning ``{method: (module, inputs)}``)
runs export … memory_plan per method, one ``emit_methods`` for the target's one
``.pte``, and verify per method::

    export[m] ─► (partition … adjust)[m] ─► memory_plan[m] ─┐ for each method m
                                           emit_methods ◄──┘ ─► verify[m] for each m

Its manifest lists the ``methods``; each target's entry has the per-method
``memory_plan``, ``delegation`` and ``verify`` under ``methods`` (the entry's own
are totals over the methods), and every stage record of one method says
``"method"``.

The DAG is written once, over a ``run(stage, records, **inputs)`` callable: the
flow's runs the stage tasks; :func:`plan_model`'s only looks the stages up in
the cache (a dry run).

Why one room: the DAG reads top-down in one place, as a Prefect flow should (the single-
and several-method paths, quantize and delegate steps side by side); the stages' logic
lives in tasks/ and lowering/, the reports in flows/reports.py.
"""

from __future__ import annotations

from .console import quiet_flow_run

quiet_flow_run()  # a worker's flow run: no library warnings on its console (before torch is imported)

import collections
import contextlib
import logging
import time
from typing import Any, Callable

from prefect import flow, get_run_logger
from prefect.exceptions import MissingContextError

from lowering.benchmark import combined, not_runnable
from lowering.methods import check_no_shared_state, check_shared_state_names, state_written_elsewhere
from lowering.targets import PORTABLE, backend_versions, chain_of, keep_for, quantizer_for, verify_tolerance
from tasks.cache import CacheConfig
from tasks.model_spec import ModelSpec, holding, load_model, modules_loaded
from tasks.run_names import labelled
from tasks.stage_tasks import IN_PROCESS_STAGES, StageLookup, StageTasks, WouldRun, call_stage
from tasks.stages import fused_ops_key, quantize_versions

from . import heartbeats, run_logs, weights_only
from .dry_run import DryRun, exported_control_flow, stored_control_flow
from .method_totals import combined_verify, total_delegation, total_plan, total_quantize
from .load_options import export_options, load_extras
from .manifest import external_by_target, profiles_by_target
from .outages import mark_outage
from .gates import Publisher, Regressed, benchmark_by_target, gates_by_target
from .history import append_history, manifest_to_store
from .published import changed_since_last, device_updates, keep_published, unpublish_failed
from .quantized import NO_QUANTIZATION, QuantSettings
from .verify_mode import check_verify, stage_mode, target_mode

heartbeats.install()
run_logs.install()  # no per-task-run "Finished in state Completed()" lines

#: The stages after export, per kind of target (preprocess repeats per partition).
PORTABLE_STAGES = ("memory_plan", "emit", "verify")
DELEGATE_STAGES = ("partition", "create_submodule", "build_programs", "preprocess", "adjust", *PORTABLE_STAGES)
#: The same for a model of several methods (emit_methods once, the others per method).
METHODS_PORTABLE_STAGES = ("memory_plan", "emit_methods", "verify")
METHODS_DELEGATE_STAGES = (*DELEGATE_STAGES[:5], *METHODS_PORTABLE_STAGES)

Run = Callable[..., Any]


class ModelLoweringFailed(RuntimeError):
    """Some target of a model failed; ``manifest`` says which stage and why."""

    explained = True  # its message says it all: no traceback at ERROR (flows/run_logs.py)
    logged = True  # and its lines were logged (_log): Prefect's repeat of it goes to DEBUG

    def __init__(self, manifest: dict) -> None:
        failed = [f"{t}: {r['error']}" for t, r in manifest["targets"].items() if not r["ok"]]
        if manifest.get("store_error"):
            failed.append(manifest["store_error"])
        if manifest.get("error"):  # one cause for all (flows/outages.py)
            failed = [manifest["error"]]
        super().__init__(f"model {manifest['name']!r}: " + "; ".join(failed))
        self.manifest = manifest


@flow(name="lower-model")
def lower_model(
    model: str,
    targets: list[str] = [PORTABLE],  # noqa: B006 - Prefect copies parameters per run
    store: str | None = None,
    options: dict[str, dict[str, Any]] | None = None,
    name: str | None = None,
    version: str | None = None,
    verify: Any = True,
    locks: str | None = None,
    dynamic_shapes: Any = None,
    quantize: Any = None,
    calibration: str | None = None,
    min_sqnr: float | None = None,
    max_error: float | None = None,
    strict: bool = False,
    hf: dict[str, Any] | None = None,
    runtime_ops: Any = None,
    trust_pickle: bool = False,
    external_weights: Any = None,
    benchmark: Any = None,
    gates: Any = None,
    accept_regressions: bool = False,
) -> dict:
    """Lower ``model`` (a model spec) for every target; returns the model manifest.

    ``benchmark``: (default: where ``gates`` are set) time each verified program on ExecuTorch's runtime of this host, and
    against the published one (:mod:`lowering.benchmark`): true, false, settings, or per
    target.  ``gates``: ``{"latency": 1.10, "size": 1.05, "error": 1.5, "sqnr_drop_db": 1.0}``
    (or per target): a program worse than the published one beyond a gate is not
    published, the target fails ``regressed`` (:mod:`flows.gates`), unless
    ``accept_regressions``.

    ``strict``: export with torch.export's strict mode.  ``hf``: an ``hf:`` model's
    task and options (``{"task": "text-generation", "max_seq_len": 1024, "dtype": ...,
    "attn": ...}``; see :mod:`tasks.hf_spec`).  ``runtime_ops``: the op sets the ``.pte``
    may call (:func:`flows.manifest.profiles_by_target`: ``"portable,quantized"``, a list, or
    ``{target: ...}``; None: all); emit fails a target that calls an op outside them.
    ``trust_pickle``: a ``.pt2`` or ``pytorch_model.bin`` the user trusts loads its pickles,
    which may run code (by default refused: :mod:`lowering.untrusted`); the manifest says
    ``"trust_pickle": true``.  ``external_weights``: true (every target), a list of targets or
    ``{target: bool}``: such a target's weights go to ``outputs/<name>/<target>.ptd`` beside its
    ``.pte``, which then holds the program only (:mod:`lowering.external`); its manifest entry
    records both files.

    ``quantize``: a recipe (``"int8"``, ``"int8-dynamic"``, ``"8da4w"`` or its mapping
    form) for every target, or ``{target: recipe or None}``; ``calibration``: int8's
    calibration data spec (default: the factory's own); ``min_sqnr`` / ``max_error``:
    a quantized target fails verify beyond them (see :mod:`flows.quantized`).

    ``dynamic_shapes``: the JSON form of torch.export's argument
    (``{"x": {"0": {"name": "batch", "min": 1, "max": 32}}}``, see
    :mod:`lowering.dynamic`); it replaces the factory's own dynamic shapes.

    ``verify``: true (``auto``: full, or quick for a model above
    :data:`lowering.verify.QUICK_ABOVE_BYTES` of weights), false (``off``), ``full``,
    ``quick``, or ``{target: mode}`` (:mod:`flows.verify_mode`).

    ``locks``: the stage lock URL (``file``, ``file:///dir``, ``redis://host:port/db``;
    None: ``$LOWERFLOW_LOCKS``, else ``file``; see :mod:`tasks.locks`).
    Raises :class:`ModelLoweringFailed` (after writing the manifest) if any target failed.
    """
    return run_model(model, targets, store, options, name, version, verify, locks, dynamic_shapes,
                     quantize, calibration, min_sqnr, max_error, strict, hf, runtime_ops, trust_pickle,
                     external_weights, benchmark, gates, accept_regressions)


def run_model(
    model: str,
    targets: list[str],
    store: str | None = None,
    options: dict[str, dict[str, Any]] | None = None,
    name: str | None = None,
    version: str | None = None,
    verify: Any = True,
    locks: str | None = None,
    dynamic_shapes: Any = None,
    quantize: Any = None,
    calibration: str | None = None,
    min_sqnr: float | None = None,
    max_error: float | None = None,
    strict: bool = False,
    hf: dict[str, Any] | None = None,
    runtime_ops: Any = None,
    trust_pickle: bool = False,
    external_weights: Any = None,
    benchmark: Any = None,
    gates: Any = None,
    accept_regressions: bool = False,
    cached_only: bool = False,
) -> dict | None:
    """The body of :func:`lower_model`, callable from any flow or task without a flow run
    of its own (a flow run costs ~1 s, which would dominate a warm fleet run).
    ``cached_only``: :func:`lower_cached`'s run (None unless every stage hits the cache).

    Each stage is first looked up in the cache (the same key and artifact checks
    the task makes); only a miss becomes a task run.  A cached task run still
    costs tens of milliseconds of Prefect API calls, which would dominate a warm
    fleet, or a resume where one stage of many failed.  Misses run as tasks
    with SERIALIZABLE isolation, so concurrent runs still compute a stage once.
    """
    verify = check_verify(verify, targets)
    config = CacheConfig.for_store(store, locks=locks)
    stages = StageTasks(config)
    lookup = StageLookup(config)
    # lower_cached binds a retrain's weights itself when no stage after it (verify, benchmark) runs
    in_process = IN_PROCESS_STAGES if cached_only and benchmark is None and gates is None and all(
        target_mode(verify, target, 0) == "off" for target in targets) else frozenset()

    def run(stage: str, records: list[dict], **inputs: Any) -> Any:
        try:
            return lookup(stage, records, **inputs)
        except WouldRun:
            if cached_only and stage not in in_process:
                raise
            records.pop()  # the lookup's would-run record; the task (or compute) records itself
            if cached_only:
                return lookup.compute(stage, records, **inputs)
            return call_stage(getattr(stages, stage), records, **inputs)

    # publishes (a hard link in a local directory: no second copy) unless a gate refuses
    gated = gates_by_target(gates, targets)
    publish = Publisher(stages.store, gated, accept_regressions, benchmark_by_target(benchmark, targets, gated=gated))

    quant = QuantSettings.of(quantize, calibration, min_sqnr, max_error, targets)
    manifest = lower_dag(run, publish, model, targets, options or {}, name, version, verify, dynamic_shapes, quant,
                         load_extras(strict, hf, trust_pickle), profiles_by_target(runtime_ops, targets),
                         external_by_target(external_weights, targets), store=stages.store)
    if cached_only and not all(t["ok"] for t in manifest["targets"].values()):
        return None  # a stage would run (or a target failed): the flow runs the model
    manifest["store"] = stages.store.url
    manifest["flow_run"] = _flow_run_id()  # a fleet on a work pool matches it to its child run
    manifest["changed"] = changed_since_last(stages.store, manifest)
    device_updates(stages.store, manifest)
    mark_outage(manifest, stages.store.url)
    _log(manifest)
    try:
        unpublish_failed(stages.store, manifest)
        keep_published(stages.store, manifest)
        stored = manifest_to_store(manifest, publish)
        if stored is not None:  # None: every target regressed; last night's manifest stays as it is
            stages.store.put_json(f"{manifest['name']}/manifest.json", stored)
        append_history(stages.store, manifest)
        if not cached_only:  # the report is a Prefect artifact of the flow run: there is none
            _publish_report(manifest, stages.store)
    except Exception as exc:  # the store went away: report the targets' own errors, and this
        manifest["store_error"] = f"cannot write the manifest to {stages.store.url}: {type(exc).__name__}: {one_line(str(exc))}"
        if mark_outage(manifest, stages.store.url):
            with contextlib.suppress(Exception):  # the report is the run's artifact, not the store's
                _publish_report(manifest, stages.store)
        raise ModelLoweringFailed(manifest) from exc
    if not all(t["ok"] for t in manifest["targets"].values()):
        raise ModelLoweringFailed(manifest)
    return manifest


def lower_cached(model: str, targets: list[str] = [PORTABLE], **options: Any) -> dict | None:  # noqa: B006
    """:func:`lower_model` without a flow run, when every stage of every target hits the
    cache: the same stages looked up, the same outputs published, the same manifest
    (``flow_run`` None, no report artifact), and no Prefect API used, so ``lowerflow lower``
    with no API server configured starts none for a cached rerun (its ephemeral server
    took 6-26 s of a SmolLM2-135M rerun).  A retrain with external weights and verify off
    (every graph stage hits, only ``bind_weights`` runs: :mod:`flows.weights_only`) binds its
    weights here too (:meth:`tasks.stage_tasks.StageLookup.compute`: its result recorded as its
    task records it).  None when another stage would run or anything fails:
    then the flow runs the model (and reports what failed).  ``options``: lower_model's.
    A model the store has no manifest of (never published: its first lowering) is not
    looked up at all, so a cold run loads and fingerprints it once."""
    from tasks.store import ArtifactStore

    try:
        store = ArtifactStore(options.get("store"))
        name = options.get("name") or ModelSpec.parse(model).name
        if not store.fs.exists(store.named_path(f"{name}/manifest.json")):
            return None
        return run_model(model, targets, **options, cached_only=True)
    except Exception:
        return None


def plan_model(
    model: str,
    targets: list[str] = [PORTABLE],  # noqa: B006
    store: str | None = None,
    options: dict[str, dict[str, Any]] | None = None,
    name: str | None = None,
    version: str | None = None,
    verify: Any = True,
    locks: str | None = None,
    dynamic_shapes: Any = None,
    quantize: Any = None,
    calibration: str | None = None,
    min_sqnr: float | None = None,
    max_error: float | None = None,
    strict: bool = False,
    hf: dict[str, Any] | None = None,
    runtime_ops: Any = None,
    trust_pickle: bool = False,
    external_weights: Any = None,
    benchmark: Any = None,
    gates: Any = None,
) -> dict:
    """Dry run of :func:`lower_model`: per target, which stages hit the cache and which would
    run (the benchmark stage where ``benchmark`` / ``gates`` turn it on, as the run would)."""
    verify = check_verify(verify, targets)
    lookup = StageLookup(CacheConfig.for_store(store, locks=locks))
    quant = QuantSettings.of(quantize, calibration, min_sqnr, max_error, targets)
    gated = gates_by_target(gates, targets)
    bench = Publisher(lookup.store, gated, benchmark=benchmark_by_target(benchmark, targets, gated=gated))
    return lower_dag(lookup, None, model, targets, options or {}, name, version, verify, dynamic_shapes, quant,
                     load_extras(strict, hf, trust_pickle), profiles_by_target(runtime_ops, targets),
                     external_by_target(external_weights, targets), dry_benchmark=bench, store=lookup.store)


def lower_dag(run: Run, publish, model, targets, options, name, version, verify, dynamic_shapes=None,
              quant: QuantSettings = NO_QUANTIZATION, extras: dict | None = None,
              runtime_ops: dict | None = None, external: dict | None = None,
              dry_benchmark: "Publisher | None" = None, store=None) -> dict:
    """Load and fingerprint the model, export it, then each target's stages
    (``runtime_ops``: ``{target: profile or None}``, emit's, :func:`profiles_by_target`;
    ``external``: ``{target: True}`` of the targets with external weights, :func:`external_by_target`).

    The factory runs on every run, cached or not: the model's fingerprint (its
    weights, code, attributes, inputs; :mod:`tasks.fingerprint`) is the export
    stage's key, so a model whose checkpoint or helper module changed is always
    re-exported.  The loaded model is handed to the export and verify stages.
    A dry run (``publish`` None) lists the benchmark stage where ``dry_benchmark`` (the
    plan's :class:`~flows.gates.Publisher`) says it runs.  ``store``: the artifact store,
    which remembers an hf: model's description (:func:`tasks.hf_spec.describe`).

    The stages get the spec as :attr:`ModelSpec.key_text` (a file's resolved path):
    it is in their keys, which must not depend on how the user spelled the path.
    """
    spec = ModelSpec.parse(model)
    name = name or spec.name
    manifest: dict[str, Any] = {"model": model, "name": name, "targets": {}}
    if (extras or {}).get("trust_pickle"):
        manifest["trust_pickle"] = True  # loaded with pickles that may run code: the user trusted it
    model = spec.key_text
    export_records: list[dict] = []
    start = time.perf_counter()
    try:
        loaded = load_model(spec, export_options(version, dynamic_shapes, extras), memo=store)
    except Exception as exc:
        export_records.append({"stage": "load", "state": "Failed", "cached": False,
                               "seconds": round(time.perf_counter() - start, 4), "bytes": None})
        return _all_failed(manifest, targets, export_records, exc)
    fingerprint = loaded.fingerprint.digest
    manifest["fingerprint"] = loaded.fingerprint.to_json()
    verify = {target: target_mode(verify, target, loaded.weights_size()) for target in targets}
    manifest["load_seconds"] = round(time.perf_counter() - start, 4)
    try:
        if loaded.methods and quant.needs_calibration:
            raise ValueError(f"model {name!r} has several methods {list(loaded.methods)}: recipe int8 (static) "
                             "calibrates one method's activations on batches of its inputs, and a model of several "
                             "methods (an hf: decoder, whose activations depend on the KV cache its calls carry) "
                             "has none; use int8-dynamic or 8da4w, which need no calibration")
        calibration = quant.calibrate(name, loaded)
    except Exception as exc:
        export_records.append({"stage": "calibration", "state": "Failed", "cached": False,
                               "seconds": round(time.perf_counter() - start, 4), "bytes": None})
        return _all_failed(manifest, targets, export_records, exc)
    if calibration is not None:
        manifest["calibration"] = calibration
    if loaded.methods:
        manifest["methods"] = list(loaded.methods)
        with holding(loaded), labelled(model=name):
            return lower_methods_dag(run, publish, manifest, loaded, targets, options, version, verify,
                                     export_options(version, None, extras), runtime_ops or {}, quant, external,
                                     dry_benchmark=dry_benchmark)
    exports = weights_only.Exports(run, loaded, model, export_options(version, dynamic_shapes, extras), export_records,
                                   targets, external, lambda t: quantize_step(quant, t, calibration),
                                   kept=lambda t: keeps_ops(t, options.get(t, {})))
    with holding(loaded), labelled(model=name):
        dry = DryRun.of(quant, targets, verify, dry_benchmark, exports.bound(),
                        frozenset(t for t in targets if keeps_ops(t, options.get(t, {})))) if publish is None else None
        try:
            exports.needed()
        except Exception as exc:
            if dry is not None and isinstance(exc, WouldRun):
                dry = dry.with_control_flow(lambda: exported_control_flow(loaded))
            return _all_failed(manifest, targets, exports.records[False] + exports.records[True], exc, dry=dry)
        if dry is not None:
            dry = dry.with_control_flow(lambda: stored_control_flow(run, next(iter(exports.done.values()))["program"]))
        for target in targets:
            with labelled(target=target):
                manifest["targets"][target] = lower_target(
                    run, publish, name, model, fingerprint, exports.program(target), target,
                    options.get(target, {}), exports.records_of(target), verify[target],
                    quantized=quantize_step(quant, target, calibration),
                    load_options=export_options(version, dynamic_shapes, extras), dry=dry,
                    runtime_ops=(runtime_ops or {}).get(target),
                    external_weights=bool((external or {}).get(target)), weights=exports.weights(target),
                )
    return manifest


def keeps_ops(target: str, options: dict) -> bool:
    """Whether ``target``'s partitioner keeps ops whole (its own export: :func:`lowering.targets.keep_for`);
    False where that cannot be told (a target that cannot be built fails in its own stages)."""
    try:
        return target != PORTABLE and keep_for(target, options) is not None
    except Exception:
        return False


def quantize_step(quant: QuantSettings, target: str, calibration: dict | None) -> dict | None:
    """What :func:`lower_target` quantizes ``target``'s program with (None: it stays fp32)."""
    recipe = quant.recipe(target)
    if recipe is None:
        return None
    static = recipe["recipe"] == "int8"
    return {"recipe": recipe, "calibration": calibration if static else None, "thresholds": quant.thresholds()}


def lower_target(run, publish, name, model, fingerprint, program, target, options, records, verify: str,
                 quantized: dict | None = None, load_options: dict | None = None,
                 dry: "DryRun | None" = None, runtime_ops: list[str] | None = None,
                 external_weights: bool = False, weights: dict | None = None) -> dict:
    """The stages after export for one target; a failure is recorded, not raised.
    ``verify``: the target's verify mode (``full``, ``quick`` or ``off``: flows.verify_mode).

    ``quantized`` (:func:`quantize_step`): the quantize stage runs first, and verify
    compares with the quantized program and reports the error against fp32 eager.
    A target whose partitioner keeps ops whole (:func:`lowering.targets.keep_for`) gets its own
    export stage first (cached on its own, keyed on the whole fingerprint: with external weights it
    is lowered fully, :data:`flows.weights_only.KEPT_OPS`).  ``external_weights``: the program's
    weights go to a ``.ptd`` (emit stores both files, verify runs the pair, both are published).
    ``weights``: :meth:`flows.weights_only.Exports.weights`."""
    external = {"external_weights": True} if external_weights else {}  # in the keys only when on
    bind = (weights or {}).get("bind")
    result: dict[str, Any] = {
        "ok": False, "pte": None, "error": None, "stages": records,
        "memory_plan": None, "delegation": None, "verify": None,
        **({"runtime_ops": runtime_ops} if runtime_ops else {}), **external,
        **({"weights_only": weights} if weights and bind is None else {}),  # {"bytes" or "fallback": why}
    }
    reference = derived = None
    try:
        kept = keep_for(target, options) if target != PORTABLE else None
        if kept is not None:  # its own export: the partitioner keeps ops whole (lowering.export.kept)
            program = run("export", records, model=model, fingerprint=fingerprint, options=load_options,
                          keep_for=kept)["program"]  # (with external weights: weights_only.KEPT_OPS)
        if quantized is not None:
            calibration = quantized["calibration"] or {}
            own = quantizer_for(target, options, quantized["recipe"])  # its backend's quantizer (Ethos-U: Arm's)
            if own is not None and external_weights:
                raise ValueError(f"target {target!r} quantizes with its backend's own quantizer, which takes no "
                                 "external weights")
            done = run("quantize", records, program=program, recipe=quantized["recipe"],
                       calibration=calibration.get("digest"), versions=quantize_versions(),
                       source=calibration.get("source"), model=model, fingerprint=fingerprint,
                       options=load_options, **({"backend": own} if own is not None else {}))
            program = reference = done["program"]
            derived = done.get("derived")  # how it quantized the weights (bind_weights quantizes a retrain's so)
            result["quantize"] = {"recipe": quantized["recipe"], "calibration": calibration.get("digest"),
                                  "quantized_nodes": done["quantized_nodes"], "weight_bytes": done["weight_bytes"]}
        if target != PORTABLE:
            program, result["delegation"] = delegate_target(run, name, program, target, options, records,
                                                              external=external)
        planned = run("memory_plan", records, program=program, state_of=None)
        result["memory_plan"] = {
            **{k: planned[k] for k in ("arena_bytes", "lower_bound", "algorithm")},
            "ref": planned["plan"].to_json(),  # the plan itself, for the report's picture
        }
        emitted = run("emit", records, program=program, plan=planned["plan"], runtime_ops=runtime_ops, **external)
        if bind is not None:  # tonight's weights bound to the structure's program (flows/weights_only.py)
            bound = weights_only.bind(run, records, bind, program, planned["plan"], emitted, quantized, reference, derived,
                                      verify, runtime_ops, model=model, fingerprint=fingerprint, options=load_options)
            if "fallback" in bound:  # not weights-only: lowered again, keyed on the weights' bytes
                program, again = weights["fallback"]()
                return lower_target(run, publish, name, model, fingerprint, program, target, options,
                                    [*records, *again], verify, quantized, load_options, dry, runtime_ops,
                                    external_weights, {"fallback": bound["fallback"]})
            emitted, reference = {**emitted, "ptd": bound["ptd"]}, bound["reference"]
            result["weights_only"] = weights_only.record(bound)
        data = {"ptd": emitted["ptd"]} if external_weights else {}
        if verify != "off":
            accuracy = {"reference": reference, **quantized["thresholds"]} if quantized is not None else {}
            report = run("verify", records, pte=emitted["pte"], model=model, fingerprint=fingerprint, method="forward",
                         options=load_options, **accuracy, **stage_mode(verify), **data,
                         tolerance=verify_tolerance(target, options))
            result["verify"] = report
            if report.get("ok") is False:
                raise RuntimeError(f"verify: the .pte does not match eager: {_verify_errors(report)}")
        benchmarked = benchmark(run, records, publish or (dry and dry.benchmark), name, target, emitted,
                                planned["arena_bytes"], result["verify"], model=model, fingerprint=fingerprint,
                                options=load_options)
        if benchmarked is not None:
            result["benchmark"] = benchmarked
        if publish is not None:  # only a verified program that passes its gates is published
            publish_files(publish, result, name, target, emitted)
        result["ok"] = True
    except Regressed as exc:  # its figures stay in the record; last night's program stays published
        result.update(ok=False, error=f"regressed: {exc}")
    except Exception as exc:
        result.update(_failed(records, exc, target, dry=dry), pte=result["pte"])
    return result


def lower_methods_dag(run: Run, publish, manifest: dict, loaded, targets, options, version, verify,
                      load_options: dict | None = None, runtime_ops: dict | None = None,
                      quant: QuantSettings = NO_QUANTIZATION, external: dict | None = None,
                      dry_benchmark: "Publisher | None" = None) -> dict:
    """:func:`lower_dag` of a model of several methods: export each method (keyed on
    the method's own fingerprint), then each target's stages.  ``load_options``: what the
    model was loaded with (default: its ``version``), for a stage retried in another process.
    ``quant``: each target's recipe quantizes every traced method (dynamic recipes only:
    :func:`lower_dag` refuses static int8 here); constant methods pass through."""
    load_options = load_options or {"version": version}
    model, name = ModelSpec.parse(manifest["model"]).key_text, manifest["name"]
    # each method's export in the key shapes its targets need (flows/weights_only.py)
    exports = weights_only.MethodExports(run, for_method, loaded, model, load_options, targets, external,
                                         lambda t: quantize_step(quant, t, None))
    try:
        exports.needed()
    except Exception as exc:
        return _all_failed(manifest, targets, exports.records[False] + exports.records[True], exc, methods=True,
                           dry=DryRun.of(quant, targets, verify, dry_benchmark, exports.bound()))
    mutated = {m: done.get("mutated_buffers", []) for m, done in next(iter(exports.done.values())).items()}
    records = exports.records[False] + exports.records[True]
    share = loaded.share_mutable_buffers
    if share:
        manifest["share_mutable_buffers"] = True
    try:
        if modules_loaded(loaded):  # an hf: model none of whose stages ran: lowerflow's own wrappers, not loaded
            modules = {method: sub.module for method, sub in loaded.methods.items()}
            (check_shared_state_names if share else check_no_shared_state)(modules, mutated)
    except Exception as exc:
        records.append({"stage": "check_methods", "state": "Failed", "cached": False, "seconds": 0.0, "bytes": None})
        return _all_failed(manifest, targets, records, exc, methods=True)
    fingerprints = {method: sub.fingerprint.digest for method, sub in loaded.methods.items()}
    for target in targets:
        with labelled(target=target):
            manifest["targets"][target] = lower_target_methods(
                run, publish, name, model, fingerprints, exports.programs(target), target, options.get(target, {}),
                list(exports.records[exports.structured[target]]),
                verify[target], shared=loaded.fingerprint.digest if share else None, stateful=any(mutated.values()),
                version=version, load_options=load_options, constants=loaded.constants,
                runtime_ops=(runtime_ops or {}).get(target),
                written_elsewhere={m: state_written_elsewhere(mutated, m) for m in mutated} if share else None,
                quantized=quantize_step(quant, target, None),
                external_weights=bool((external or {}).get(target)), dry_benchmark=dry_benchmark,
                weights=exports.weights(target),
            )
    return manifest


def lower_target_methods(run, publish, name, model, fingerprints, programs, target, options, records, verify: str,
                         shared: str | None = None, stateful: bool = False, version: str | None = None,
                         load_options: dict | None = None, constants: dict | None = None,
                         runtime_ops: list[str] | None = None,
                         written_elsewhere: dict[str, list[str]] | None = None,
                         quantized: dict | None = None, external_weights: bool = False,
                         dry_benchmark: "Publisher | None" = None, weights: dict | None = None) -> dict:
    """The stages after export of every method for one target, one emit, verify per method.

    ``shared`` (the model's fingerprint) when the methods share their mutable buffers:
    every method is delegated before any is memory-planned (the shared state's places
    depend on every method's program), and verify also runs the methods in sequence
    on one program (stage ``verify_sequence``).  ``stateful``: some method mutates a
    buffer; then each method's memory plan places the state of all (arena 2).  ``constants``:
    the program's constant methods (an hf: model's metadata), written by emit_methods.
    ``written_elsewhere``: per method, the shared buffers only other methods write (state
    its partition stage must not take as constant data).  ``quantized`` (:func:`quantize_step`):
    every method is quantized first with the same recipe (stage ``quantize`` per method, keyed
    as a one-method model's; mutable buffers are not touched, so shared state stays shared),
    and verify compares each method, and the sequence, with the quantized programs.
    ``verify``: the target's mode, as :func:`lower_target`'s (the check of shared state,
    ``verify_sequence``, runs in both).  ``external_weights``: as :func:`lower_target`'s
    (one ``.ptd`` for every method).  The benchmark stage times each method on its own (each
    method's record has its report; the target's, :func:`lowering.benchmark.combined`).
    ``dry_benchmark``: a dry run's :class:`~flows.gates.Publisher` (where the stage would run).
    ``weights``: :meth:`flows.weights_only.MethodExports.weights` (stage ``bind_weights_methods``
    after emit_methods binds tonight's weights to the structure-keyed programs)."""
    load_options = load_options or {"version": version}
    external = {"external_weights": True} if external_weights else {}  # in the keys only when on
    bind = (weights or {}).get("bind")
    methods: dict[str, dict] = {m: {"memory_plan": None, "delegation": None, "verify": None} for m in programs}
    result: dict[str, Any] = {
        "ok": False, "pte": None, "error": None, "stages": records,
        "memory_plan": None, "delegation": None, "verify": None, "methods": methods,
        **({"runtime_ops": runtime_ops} if runtime_ops else {}), **external,
        **({"weights_only": weights} if weights and bind is None else {}),  # {"bytes" or "fallback": why}
    }
    references: dict[str, Any] = {}
    derived: dict[str, Any] = {}
    try:
        planned, delegated = {}, {}
        if quantized is not None:
            programs = {method: references.setdefault(method, quantize_method(
                for_method(run, method), records, program, quantized, model, fingerprints[method], load_options,
                methods[method], derived, method)) for method, program in programs.items()}
            result["quantize"] = total_quantize(quantized["recipe"], [methods[m]["quantize"] for m in methods])
        for method, program in programs.items():
            if target != PORTABLE:
                program, methods[method]["delegation"] = delegate_target(
                    for_method(run, method), f"{name}.{method}", program, target, options, records,
                    shared_state=(written_elsewhere or {}).get(method) or None, external=external)
            delegated[method] = program
        for method, program in delegated.items():
            state_of = {"method": method, "programs": dict(delegated), "share": bool(shared)} if stateful else None
            plan = for_method(run, method)("memory_plan", records, program=program, state_of=state_of)
            methods[method]["memory_plan"] = {
                **{k: plan[k] for k in ("arena_bytes", "lower_bound", "algorithm", "shared_state_bytes") if k in plan},
                "ref": plan["plan"].to_json(),
            }
            planned[method] = {"program": program, "plan": plan["plan"]}
        result["memory_plan"] = total_plan([m["memory_plan"] for m in methods.values()])
        if target != PORTABLE:
            result["delegation"] = total_delegation([m["delegation"] for m in methods.values()])
        emitted = run("emit_methods", records, methods=planned, **({"constants": constants} if constants else {}),
                      runtime_ops=runtime_ops, **external)
        if bind is not None:  # tonight's weights bound to the structure's programs (flows/weights_only.py)
            bound = weights_only.bind_methods(run, records, bind, planned, emitted, quantized, references, derived,
                                              verify, runtime_ops, constants, model=model, fingerprints=fingerprints,
                                              options=load_options)
            if "fallback" in bound:  # not weights-only: lowered again, keyed on the weights' bytes
                again, again_records = weights["fallback"]()
                return lower_target_methods(
                    run, publish, name, model, fingerprints, again, target, options, [*records, *again_records],
                    verify, shared, stateful, version, load_options, constants, runtime_ops, written_elsewhere,
                    quantized, external_weights, dry_benchmark, weights={"fallback": bound["fallback"]})
            emitted, references = {**emitted, "ptd": bound["ptd"]}, bound["references"] or references
            result["weights_only"] = weights_only.record(bound)
        data = {"ptd": emitted["ptd"]} if external_weights else {}
        if verify != "off":
            for method in programs:
                accuracy = {"reference": references[method], **quantized["thresholds"]} if references else {}
                methods[method]["verify"] = for_method(run, method)(
                    "verify", records, pte=emitted["pte"], model=model, fingerprint=fingerprints[method], method=method,
                    options=load_options, **accuracy, **stage_mode(verify), **data)
            reports = {m: e["verify"] for m, e in methods.items()}
            if shared:
                result["verify_sequence"] = reports["(sequence)"] = run(
                    "verify_sequence", records, pte=emitted["pte"], model=model, fingerprint=shared,
                    options=load_options, **({"references": references} if references else {}), **data)
            result["verify"] = combined_verify(reports)
            if result["verify"].get("ok") is False:
                raise RuntimeError(f"verify: the .pte does not match eager: {_verify_errors(result['verify'])}")
        reports = {}
        for method in programs:  # each method timed on its own (an hf: model: its forward)
            report = benchmark(for_method(run, method), records, publish or dry_benchmark, name, target, emitted,
                               methods[method]["memory_plan"]["arena_bytes"], methods[method]["verify"], model=model,
                               fingerprint=fingerprints[method], method=method, options=load_options)
            if report is not None:
                reports[method] = methods[method]["benchmark"] = report
        if reports:
            result["benchmark"] = reports[method] if len(reports) == 1 else {
                **combined(reports), "arena_bytes": result["memory_plan"]["arena_bytes"],
                **{k: report[k] for k in ("pte_bytes", "ptd_bytes") if k in report}}
        if publish is not None:
            publish_files(publish, result, name, target, emitted)
        result["ok"] = True
    except Regressed as exc:
        result.update(ok=False, error=f"regressed: {exc}")
    except Exception as exc:
        dry = DryRun(frozenset({target} if quantized is not None else ()), frozenset({target} if verify == "off" else ()),
                     benchmark=dry_benchmark, bound=frozenset({target} if bind is not None else ()))
        result.update(_failed(records, exc, target, methods=True, dry=dry), pte=result["pte"], methods=methods)
    return result


def quantize_method(run: Run, records: list[dict], program, quantized: dict, model: str, fingerprint: str,
                    load_options: dict, entry: dict, derived: dict | None = None, method: str = "forward"):
    """Stage ``quantize`` of one method (a dynamic recipe: no calibration); its record goes in
    the method's ``entry``, how it derived its constants in ``derived[method]`` (bind_weights_methods
    quantizes a retrain's weights so); returns the quantized program's ref."""
    done = run("quantize", records, program=program, recipe=quantized["recipe"], calibration=None,
               versions=quantize_versions(), source=None, model=model, fingerprint=fingerprint, options=load_options)
    entry["quantize"] = {"quantized_nodes": done["quantized_nodes"], "weight_bytes": done["weight_bytes"]}
    if derived is not None:
        derived[method] = done.get("derived")
    return done["program"]


def for_method(run: Run, method: str) -> Run:
    """``run`` whose stage records say which method they are of (``"method": name``),
    as do its task runs' names (``emit[lm.decode/portable]``)."""

    def run_method(stage: str, records: list[dict], **inputs: Any) -> Any:
        start = len(records)
        try:
            with labelled(method=method):
                return run(stage, records, **inputs)
        finally:
            for record in records[start:]:
                record["method"] = method

    return run_method


def delegate_target(run: Run, name, program, target, options, records, shared_state: list[str] | None = None,
                    external: dict | None = None):
    """:func:`delegate` for one backend, or for each backend of a chain in turn (each one's
    partitioner sees what the ones before it left); the summary says per backend what it took."""
    chain = chain_of(target, options)
    if chain is None:
        return delegate(run, name, program, target, options, records, shared_state, external)
    backends = {}
    for backend, backend_options in chain:
        with labelled(target=f"{target}:{backend}"):
            program, backends[backend] = delegate(run, name, program, backend, backend_options, records, shared_state,
                                                  external, tags=True)
    summaries = list(backends.values())
    summary = {
        "partitions": sum(s["partitions"] for s in summaries),
        "delegated_nodes": sum(s["delegated_nodes"] for s in summaries),
        "total_nodes": summaries[0]["total_nodes"],
        "backends": backends,
    }
    seconds = [s["compile_seconds"] for s in summaries if "compile_seconds" in s]
    if seconds:
        summary["compile_seconds"] = round(sum(seconds), 4)
    return program, summary


def delegate(run: Run, name, program, target, options, records, shared_state: list[str] | None = None,
             external: dict | None = None, tags: bool = False):
    """Stages 2–6: returns (delegated program ref, delegation summary).  ``shared_state``:
    buffers another method writes (:func:`lowering.methods.mark_shared_state`).  A plugin
    backend's compiles are keyed on its compiler versions too, and the summary holds the
    seconds they took (``compile_seconds``, as when compiled: a cache hit costs none).  ``tags``: the
    summary lists the partitions' tags (a chain's step; always for a plugin backend).  ``external``:
    ``{"external_weights": True}`` when the target's weights are external (the partitions ask
    their backend for stable keys: :data:`lowering.delegation.EXTERNAL_WEIGHTS_SPEC`)."""
    external = external or {}
    tagged = run("partition", records, program=program, target=target, options=options,
                 fused_ops=fused_ops_key(target, options), shared_state=shared_state, **external)
    if not tagged["partitions"]:
        summary = {"partitions": 0, "delegated_nodes": 0, "total_nodes": tagged["total_nodes"]}
        return delegate_control_flow(run, tagged["program"], tagged, target, options, records, summary, external)
    plan = run("create_submodule", records, tagged=tagged["tagged"])["plan"]
    built = run("build_programs", records, tagged=tagged["tagged"], plan=plan)
    partitions = []
    versions = {}
    for index, part in enumerate(built["partitions"]):
        if part["backend_id"] not in versions:
            versions[part["backend_id"]] = backend_versions(part["backend_id"])
        with labelled(partition=index):  # its task run: preprocess[cnn/xnnpack#0]
            done = run(
                "preprocess", records,
                program=part["program"], backend_id=part["backend_id"],
                compile_specs=part["compile_specs"], label=f"{name}/{part['tag']}",
                versions=versions[part["backend_id"]],
            )
        partitions.append({**part, **done})
    adjusted = run("adjust", records, tagged=tagged["tagged"], plan=plan, partitions=partitions)
    summary = {
        "partitions": len(partitions),
        "delegated_nodes": adjusted["delegated_nodes"],
        "total_nodes": tagged["total_nodes"],
    }
    if tags or any(versions.values()):
        summary["partition_tags"] = [p["tag"] for p in partitions]
    if any(versions.values()):  # a plugin backend: its vendor compiles
        summary["compile_seconds"] = round(sum(p.get("compile_seconds", 0.0) for p in partitions), 4)
    return delegate_control_flow(run, adjusted["program"], tagged, target, options, records, summary, external)


def delegate_control_flow(run: Run, program, tagged, target, options, records, summary, external: dict | None = None):
    """The partitions inside cond branches / map bodies, when the program has any
    (stage ``lower_control_flow``); returns (program ref, summary with them counted)."""
    if not tagged.get("control_flow"):
        return program, summary
    inner = run("lower_control_flow", records, program=program, target=target, options=options, **(external or {}))
    summary = {
        **summary,
        "partitions": summary["partitions"] + inner["partitions"],
        "delegated_nodes": summary["delegated_nodes"] + inner["delegated_nodes"],
    }
    return inner["program"], summary


def benchmark(run: Run, records: list[dict], benchmarker: "Publisher | None", name: str, target: str, emitted: dict,
              arena_bytes: int | None, verify: dict | None = None, **inputs: Any) -> dict | None:
    """Stage ``benchmark`` of a verified program (with its ``.ptd``, external weights), where
    it is on for ``target``: the stage's report with the program's bytes (None: off).  Not
    run where ``verify`` (its report) found ExecuTorch's runtime cannot run the program.
    ``benchmarker``: the run's :class:`~flows.gates.Publisher` (in a dry run, the plan's: it
    only reads what is published); ``inputs``: the model's (``model``, ``fingerprint``, ...)."""
    bench = None if benchmarker is None else benchmarker.benchmark_inputs(name, target, emitted["pte"], emitted.get("ptd"))
    if bench is None:
        return None
    skipped = not_runnable(verify)  # (a ReferenceBackend program): no stage, no task run
    report = {"skipped": skipped} if skipped else run("benchmark", records, pte=emitted["pte"], **inputs, **bench)
    ptd = emitted.get("ptd")
    return {**report, "pte_bytes": emitted["pte"].size, **({"ptd_bytes": ptd.size} if ptd is not None else {}),
            "arena_bytes": arena_bytes}


def publish_files(publish, result: dict, name: str, target: str, emitted: dict) -> None:
    """Publish the target's ``.pte`` (and its ``.ptd``: the entry says which data file the
    program needs, with the sha256 of each) into ``result``."""
    result["pte"] = publish(name, target, emitted["pte"], result=result, data=emitted.get("ptd"))  # raises Regressed past a gate
    if emitted.get("ptd") is not None:
        result["ptd"] = publish(name, target, emitted["ptd"], "ptd")
        result["pte"]["needs"] = f"{target}.ptd"


def _all_failed(manifest: dict, targets, records: list[dict], exc: BaseException, methods: bool = False,
                dry: "DryRun | None" = None) -> dict:
    """Every target failed (or, in a dry run, would run) at the same early stage."""
    for target in targets:
        manifest["targets"][target] = _failed(list(records), exc, target, methods, dry)
    return manifest


def _failed(records: list[dict], exc: BaseException, target: str, methods: bool = False,
            dry: DryRun | None = None) -> dict:
    if isinstance(exc, WouldRun):  # dry run: the rest of the DAG would run
        if methods:
            rest = METHODS_PORTABLE_STAGES if target == PORTABLE else METHODS_DELEGATE_STAGES
        else:
            rest = PORTABLE_STAGES if target == PORTABLE else DELEGATE_STAGES
        # the model's export, then the rest: each stage listed as often as it runs (a kept-ops
        # target's second export), less the times the records already have it
        done = collections.Counter(r["stage"] for r in records)
        for s in ("export", *(dry or DryRun()).rest(target, rest)):
            if done[s]:
                done[s] -= 1
            else:
                records.append({"stage": s, "cached": False, "state": "WouldRun", "seconds": 0.0, "bytes": None})
        return {"ok": None, "pte": None, "stages": records, "error": None,
                "memory_plan": None, "delegation": None, "verify": None}
    stage = next((r["stage"] + (f"[{r['method']}]" if r.get("method") else "")
                  for r in reversed(records) if r["state"] not in ("Completed", "Cached")), None)
    message = one_line(str(exc)) or type(exc).__name__
    return {
        "ok": False, "pte": None, "stages": records,
        "error": f"{stage or 'verify'}: {type(exc).__name__}: {message}",
        "memory_plan": None, "delegation": None, "verify": None,
    }


def one_line(text: str, limit: int = 400) -> str:
    """A message as one line: its first line, and when that line only announces what
    follows (ends with ':', as torch's ``load_state_dict`` errors do), the lines after
    it joined with '; ', cut at ``limit`` characters."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    out = lines[0]
    if out.endswith(":") and len(lines) > 1:
        out = f"{out} {'; '.join(lines[1:])}"
    return out if len(out) <= limit else out[: limit - 1] + "…"


def _verify_errors(report: dict) -> str:
    return "; ".join(
        f"{c['runtime']}{' (' + c['method'] + ')' if c.get('method') else ''}: {c.get('error')}"
        for c in report.get("checks", []) if c["ok"] is False
    )


def _flow_run_id() -> str | None:
    from prefect.runtime import flow_run

    return flow_run.get_id()


def _log(manifest: dict) -> None:
    """A line per target (:func:`flows.run_logs.target_line`: outcome, stages run and
    cached, seconds), or one for all when one cause failed them all; stages at DEBUG."""
    try:
        logger = get_run_logger()
    except MissingContextError:  # lower_cached: no flow run; the logger a run's records use
        logger = logging.getLogger("prefect.flow_runs")
    name = manifest["name"]
    if manifest.get("changed"):
        logger.info("%s: re-lowered: %s changed", name, ", ".join(manifest["changed"]))
    for target, result in manifest["targets"].items():
        for r in result["stages"]:
            state = "cached" if r["cached"] else r["state"].lower()
            logger.debug("%s/%s %-16s %-9s %.3fs", name, target, r["stage"], state, r["seconds"])
        if result.get("ok") and not manifest.get("error"):
            logger.info("%s", run_logs.target_line(name, target, result))
    for line in run_logs.failure_lines(name, manifest):  # a line per cause (flows/outages.py: one for all)
        target = line.split(" ", 1)[0].split("/", 1)[1]
        logger.error("%s", run_logs.target_line(name, target, manifest["targets"][target])
                     if target in manifest["targets"] and not manifest.get("error") else line)  # one target: its stages too


def _publish_report(manifest: dict, store) -> None:
    from flows.reports import publish_model_report

    publish_model_report(manifest, store)
