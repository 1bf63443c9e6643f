"""Fleet manifests: which models to lower, for which targets, into which store.

    store: ./.lowerflow                      # any fsspec URL (default: $LOWERFLOW_STORE or ./.lowerflow)
    locks: redis://locks.internal:6379/0     # optional stage lock URL (default: $LOWERFLOW_LOCKS or file)
    defaults: {targets: [portable, reference], verify: true}
    models:
      - name: mlp                            # optional: defaults to the factory / file name
        model: examples/models.py:mlp        # a model spec (tasks.model_spec)
        targets: [portable, reference]       # optional: defaults.targets; a chain of backends is
                                             #   {name: android, backends: [vulkan, xnnpack]}
        options: {reference: {...}}          # optional: partitioner options per target
        version: "1"                         # optional: an extra salt of the export key
        verify: true                         # optional: true (auto: full, quick above 64 MiB of weights),
                                             #   false, full, quick, off, auto, or per target {xnnpack: quick}
        dynamic_shapes:                      # optional: dynamic dims, by forward argument
          x: {0: {name: batch, min: 1, max: 32}}   # (or a list by position); replaces the factory's
        quantize: int8                       # optional: a recipe (int8, int8-dynamic, 8da4w, or
                                             #   {recipe: 8da4w, group_size: 64, keep_fp32: [lm_head],
                                             #    quantize_mha: false})
                                             #   for every target, or per target: {xnnpack: int8, portable: null}
        qembedding: 4w                       # optional: with int8-dynamic / 8da4w, the embedding tables too:
                                             #   8w (int8, a scale per row) or 4w (int4, a scale per 32 values)
        calibration: data.py:batches         # optional: int8's calibration data (a function spec or a
                                             #   safetensors URL; default: the factory's "calibration")
        min_sqnr: 20                         # optional: fail a quantized target below this SQNR (dB)
        max_error: 0.05                      # optional: ... or above this max|Δ| / max|fp32| vs fp32 eager
        strict: true                         # optional: torch.export's strict mode (default false)
        trust_pickle: true                   # optional: a .pt2 / pytorch_model.bin you trust may unpickle
                                             #   (run code); default false: refused (docs/security.md)
        runtime_ops: [portable, quantized]   # optional: the op sets the .pte may call (lowering.stock_ops;
                                             #   default all: portable, quantized, llm, fused), a list or
                                             #   "portable,quantized", for every target or per target
        external_weights: true               # optional: weights in <target>.ptd beside the .pte (true,
                                             #   a list of targets, or {xnnpack: true}); docs/external-weights.md
      - model: hf:./tiny-llama               # a Hugging Face model directory (or hub id) ...
        task: text-generation                # ... with its task (required for hf:) and options:
        max_seq_len: 1024                    #   max_seq_len, dtype (float32/float16/bfloat16), attn (standard/custom),
                                             #   last_token_logits (true: forward returns [1, V])

The whole manifest is validated before any work starts; every error names the
entry (``models[2] ('cnn')``) and the field.  Besides its fields, each entry's
factory is resolved (its file exists, its module imports, the attribute is
callable; not called) and each target's partitioner is made with the entry's
options, so a typo in either is a bad manifest, never a model failing mid-fleet.
A YAML or JSON syntax error names its line and column.  Relative ``.py`` paths and a relative
local store, and relative hf: directories, are resolved against the manifest file's directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any, Mapping

import yaml

from lowering.errors import BackendError
from lowering.targets import PORTABLE, check_target, partitioner_for
from tasks.calibration import CalibrationError, check_calibration_source
from tasks.locks import LockConfigError, parse_lock_url
from tasks.model_spec import ModelSpec, ModelSpecError, check_spec, resolve_factory

from .verify_mode import check_verify

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
#: An hf: model's keys: its task and the options of lowering.hf (load_hf).
HF_KEYS = ("task", "max_seq_len", "dtype", "attn", "last_token_logits")
_MODEL_KEYS = {"name", "model", "targets", "options", "version", "verify", "dynamic_shapes",
               "quantize", "qembedding", "calibration", "min_sqnr", "max_error", "strict", "runtime_ops",
               "trust_pickle", "external_weights", "benchmark", "gates", "accept_regressions", *HF_KEYS}
_TOP_KEYS = {"store", "locks", "defaults", "models"}


class ManifestError(ValueError):
    """A fleet manifest that cannot be used; the message names the bad entry."""

    explained = True  # its message says it all: one line, the traceback at DEBUG (flows/run_logs.py)


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    name: str
    model: str
    targets: tuple[str, ...]
    options: Mapping[str, Mapping[str, Any]]
    version: str | None
    verify: Any
    #: The canonical JSON form (lowering.dynamic), or None.
    dynamic_shapes: Any = None
    #: Target -> quantize recipe (mapping form) or None (fp32): :func:`recipes_by_target`.
    quantize: Mapping[str, Any] | None = None
    #: The calibration spec (tasks.calibration), or None: the factory's own, if any.
    calibration: str | None = None
    #: Accuracy thresholds of quantized targets (verify): SQNR floor (dB), error ceiling.
    min_sqnr: float | None = None
    max_error: float | None = None
    #: Export with torch.export's strict mode.
    strict: bool = False
    #: A .pt2 / pytorch_model.bin the user trusts: its pickles load (and may run code).
    trust_pickle: bool = False
    #: An hf: model's task and options (``{"task": ..., "max_seq_len": ...}``), or None.
    hf: Mapping[str, Any] | None = None
    #: Target -> runtime profile (a list of op sets) or None (the default): :func:`profiles_by_target`.
    runtime_ops: Mapping[str, Any] | None = None
    #: Target -> True for the targets whose weights go to a ``.ptd``: :func:`external_by_target`.
    external_weights: Mapping[str, bool] | None = None
    #: The benchmark setting (flows.gates.benchmark_by_target; None: on where gates are set).
    benchmark: Any = None
    #: Target -> {figure: limit} (flows.gates.gates_by_target), or None: no gate.
    gates: Mapping[str, Any] | None = None
    #: Publish a program a gate refuses anyway (the record says so).
    accept_regressions: bool = False


@dataclasses.dataclass(frozen=True)
class FleetManifest:
    store: str | None
    models: tuple[ModelEntry, ...]
    #: The stage lock URL (tasks.locks.parse_lock_url); None: $LOWERFLOW_LOCKS, else file.
    locks: str | None = None


def load_manifest(source: str | os.PathLike | Mapping[str, Any]) -> FleetManifest:
    """Parse and validate a manifest (a YAML/JSON file path or an already-parsed dict)."""
    base = Path.cwd()
    origin = "manifest"
    if isinstance(source, Mapping):
        doc = source
    else:
        path = Path(source)
        if not path.is_file():
            raise ManifestError(f"manifest {str(path)!r} does not exist")
        try:
            text = path.read_text()
            doc = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (yaml.YAMLError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ManifestError(f"manifest {str(path)!r}{_syntax_error(exc)}") from exc
        base = path.resolve().parent
        origin = f"manifest {str(path)!r}"
    return _validate(doc, base, origin)


def _syntax_error(exc: Exception) -> str:
    """``", line L, column C: not valid YAML: <problem>"`` (1-based, as editors count)."""
    if isinstance(exc, json.JSONDecodeError):
        return f", line {exc.lineno}, column {exc.colno}: not valid JSON: {exc.msg}"
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        problem = " ".join(p for p in (exc.context, exc.problem) if p) or "syntax error"
        if mark is not None:
            return f", line {mark.line + 1}, column {mark.column + 1}: not valid YAML: {problem}"
        return f": not valid YAML: {problem}"
    if isinstance(exc, UnicodeDecodeError):
        return f": not UTF-8 text: {exc.reason} at byte {exc.start}"
    return f": not valid YAML: {' '.join(str(exc).split())}"


def _validate(doc: Any, base: Path, origin: str = "manifest") -> FleetManifest:
    if not isinstance(doc, Mapping):
        raise ManifestError("manifest must be a mapping with a 'models' list")
    unknown = set(doc) - _TOP_KEYS
    if unknown:
        raise ManifestError(f"manifest has unknown keys {sorted(unknown)}; allowed: {sorted(_TOP_KEYS)}")
    store = doc.get("store")
    if store is not None and (not isinstance(store, str) or not store):
        raise ManifestError(f"manifest 'store' must be a URL string, got {store!r}")
    _no_placeholder(doc, origin)
    if store is not None and "://" not in store and not os.path.isabs(store):
        store = str((base / store).resolve())
    locks = _locks(doc.get("locks"), origin)
    defaults = doc.get("defaults") or {}
    if not isinstance(defaults, Mapping):
        raise ManifestError("manifest 'defaults' must be a mapping")
    models = doc.get("models")
    if not isinstance(models, list) or not models:
        raise ManifestError("manifest 'models' must be a non-empty list")
    entries = [_entry(i, m, defaults, base) for i, m in enumerate(models)]
    seen: dict[str, int] = {}
    for i, entry in enumerate(entries):
        if entry.name in seen:
            raise ManifestError(f"models[{i}] ({entry.name!r}): name already used by models[{seen[entry.name]}]")
        seen[entry.name] = i
    return FleetManifest(store, tuple(entries), locks)


def _no_placeholder(doc: Mapping[str, Any], origin: str) -> None:
    """An example's ``store``/``locks`` still reads ``s3://<your-bucket>/...``: say so."""
    for key in ("store", "locks"):
        found = re.search(r"<[^<>]+>", doc[key]) if isinstance(doc.get(key), str) else None
        if found:
            raise ManifestError(f"{origin}: '{key}' {doc[key]!r} still has the placeholder {found.group()}: "
                                f"set it to your {'object store URL' if key == 'store' else 'Redis URL'} "
                                "(one every worker machine reaches)")


def _locks(value: Any, origin: str) -> str | None:
    """The manifest's ``locks`` (a lock URL), checked as tasks.cache would check it."""
    if value is None:
        return None
    try:
        parse_lock_url(value, where=f"{origin}: locks")
    except LockConfigError as exc:
        raise ManifestError(str(exc)) from None
    return value.strip()


def _entry(i: int, raw: Any, defaults: Mapping[str, Any], base: Path) -> ModelEntry:
    where = f"models[{i}]"
    if isinstance(raw, str):
        raw = {"model": raw}
    if not isinstance(raw, Mapping):
        raise ManifestError(f"{where}: expected a mapping or a model spec string, got {type(raw).__name__}")
    if "name" in raw:
        where = f"models[{i}] ({raw['name']!r})"
    unknown = set(raw) - _MODEL_KEYS
    if unknown:
        raise ManifestError(f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(_MODEL_KEYS)}")
    if "model" not in raw:
        raise ManifestError(f"{where}: missing 'model' (a spec like 'path/file.py:factory')")
    try:
        spec = ModelSpec.parse(raw["model"])
    except ModelSpecError as exc:
        raise ManifestError(f"{where}: {exc}") from exc
    model = raw["model"]
    if spec.kind == "file":
        path = Path(spec.location)
        if not path.is_absolute():
            path = base / path
        if not path.is_file():
            raise ManifestError(f"{where}: model file {spec.location!r} does not exist")
        model = f"{path}:{spec.factory}"
    hf = _hf_keys(where, raw, spec)
    trust_pickle = raw.get("trust_pickle", False)
    if not isinstance(trust_pickle, bool):
        raise ManifestError(f"{where}: 'trust_pickle' must be true or false")
    if spec.kind == "hf":
        if not Path(spec.location).expanduser().is_absolute() and (base / spec.location).is_dir():
            model = f"hf:{base / spec.location}"
        try:
            check_spec(ModelSpec.parse(model), options={"hf": hf, **({"trust_pickle": True} if trust_pickle else {})})
        except ModelSpecError as exc:
            raise ManifestError(f"{where}: {exc}") from None
    elif spec.kind != "pt2":
        try:
            resolve_factory(ModelSpec.parse(model))
        except ModelSpecError as exc:
            raise ManifestError(f"{where}: {exc}") from None
    name = raw.get("name", spec.name)
    if not isinstance(name, str) or not _NAME.match(name):
        raise ManifestError(f"{where}: name {name!r} must be letters, digits, '.', '_' or '-'")
    targets = raw.get("targets", defaults.get("targets", [PORTABLE]))
    if isinstance(targets, str):
        targets = [targets]
    targets, chains = _chain_targets(where, targets)
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise ManifestError(f"{where}: 'targets' must be a non-empty list of target names")
    if len(set(targets)) != len(targets):
        raise ManifestError(f"{where}: 'targets' lists a target twice: {targets}")
    options = raw.get("options", {})
    if not isinstance(options, Mapping) or not all(isinstance(v, Mapping) for v in options.values()):
        raise ManifestError(f"{where}: 'options' must map target names to option mappings")
    options = {**options, **{t: {**options.get(t, {}), **chain} for t, chain in chains.items()}}
    for target in targets:
        _check_target(where, target, options.get(target))
    stray = set(options) - set(targets)
    if stray:
        raise ManifestError(f"{where}: 'options' for targets not lowered: {sorted(stray)}")
    for target, target_options in options.items():
        try:
            partitioner_for(target, target_options)
        except BackendError as exc:
            raise ManifestError(f"{where}: 'options': {exc}") from None
    version = raw.get("version")
    if version is not None and not isinstance(version, (str, int)):
        raise ManifestError(f"{where}: 'version' must be a string")
    try:
        verify = check_verify(raw.get("verify", defaults.get("verify", True)), targets, f"{where}: 'verify'")
    except ValueError as exc:
        raise ManifestError(str(exc)) from None
    strict = raw.get("strict", False)
    if not isinstance(strict, bool):
        raise ManifestError(f"{where}: 'strict' must be true or false")
    dynamic_shapes = raw.get("dynamic_shapes")
    if dynamic_shapes is not None:
        if spec.kind == "pt2":
            raise ManifestError(f"{where}: 'dynamic_shapes' is only for a factory; a .pt2 program "
                                "carries its own")
        dynamic_shapes = canonical_dynamic_shapes(dynamic_shapes, f"{where}: 'dynamic_shapes'")
    quantize = with_qembedding(recipes_by_target(raw.get("quantize"), targets, f"{where}: 'quantize'"),
                               raw.get("qembedding"), f"{where}: 'qembedding'")
    runtime_ops = profiles_by_target(raw.get("runtime_ops"), targets, f"{where}: 'runtime_ops'")
    external_weights = external_by_target(raw.get("external_weights"), targets, f"{where}: 'external_weights'")
    calibration = raw.get("calibration")
    if calibration is not None:
        if isinstance(calibration, str) and ".py:" in calibration and "://" not in calibration:
            location, _, function = calibration.rpartition(":")
            if not Path(location).is_absolute():
                calibration = f"{base / location}:{function}"
        try:
            calibration = check_calibration_source(calibration, f"{where}: 'calibration'")
        except CalibrationError as exc:
            raise ManifestError(str(exc)) from None
    regressions = _regression_keys(where, raw, defaults, targets)
    thresholds = {k: _threshold(where, k, raw.get(k)) for k in ("min_sqnr", "max_error")}
    if any(v is not None for v in thresholds.values()) and not quantize:
        raise ManifestError(f"{where}: 'min_sqnr' and 'max_error' are for quantized targets; "
                            "the entry has no 'quantize'")
    return ModelEntry(
        name=name,
        model=model,
        targets=tuple(targets),
        options={k: dict(v) for k, v in options.items()},
        version=None if version is None else str(version),
        verify=verify,
        dynamic_shapes=dynamic_shapes,
        quantize=quantize,
        calibration=calibration,
        **thresholds,
        strict=strict,
        trust_pickle=trust_pickle,
        hf=hf,
        runtime_ops=runtime_ops,
        external_weights=external_weights,
        **regressions,
    )


def _regression_keys(where: str, raw: Mapping[str, Any], defaults: Mapping[str, Any], targets) -> dict[str, Any]:
    """The entry's ``benchmark``, ``gates`` and ``accept_regressions`` (else ``defaults``'),
    checked (flows/gates.py)."""
    from .gates import benchmark_by_target, gates_by_target

    values = {k: raw.get(k, defaults.get(k)) for k in ("benchmark", "gates", "accept_regressions")}
    try:
        benchmark_by_target(values["benchmark"], targets, f"{where}: 'benchmark'")
        values["gates"] = gates_by_target(values["gates"], targets, f"{where}: 'gates'")
    except ValueError as exc:
        raise ManifestError(str(exc)) from None
    if not isinstance(values["accept_regressions"] or False, bool):
        raise ManifestError(f"{where}: 'accept_regressions' must be true or false")
    values["accept_regressions"] = bool(values["accept_regressions"])
    return values


def _hf_keys(where: str, raw: Mapping[str, Any], spec: ModelSpec) -> dict[str, Any] | None:
    """An hf: entry's task and options; the keys on any other entry are an error."""
    given = {k: raw[k] for k in HF_KEYS if raw.get(k) is not None}
    if spec.kind != "hf":
        if given:
            raise ManifestError(f"{where}: {sorted(given)} are for an hf: model, not {spec.text!r}")
        return None
    if "task" not in given:
        raise ManifestError(f"{where}: an hf: model needs a 'task' (text-generation, fill-mask, ...)")
    return given


def recipes_by_target(value: Any, targets: list[str] | tuple[str, ...], where: str = "quantize") -> dict | None:
    """A ``quantize`` setting as ``{target: recipe mapping or None}`` (None: no target quantized).

    ``value``: None; a recipe (``"int8"``, ``{"recipe": "8da4w", "group_size": 64}``) for
    every target; or per target ``{"xnnpack": "int8", "portable": None}`` (targets not
    named stay fp32).  Recipes come back in canonical mapping form (equal recipes,
    equal cache keys).
    """
    from lowering.quantize import QuantizeError, parse_recipe

    if value is None:
        return None
    per_target = isinstance(value, Mapping) and "recipe" not in value
    if per_target:
        stray = sorted(set(map(str, value)) - set(targets))
        if stray:
            raise ManifestError(f"{where}: names targets not lowered: {stray} (lowered: {list(targets)})")
    try:
        recipes = {t: (value.get(t) if per_target else value) for t in targets}
        recipes = {t: (None if r is None else parse_recipe(r)) for t, r in recipes.items()}
        for target, recipe in recipes.items():
            if recipe is not None and target == PORTABLE:
                recipe.check_portable(f"target {target!r}")
        recipes = {t: (None if r is None else r.to_dict()) for t, r in recipes.items()}
    except QuantizeError as exc:
        raise ManifestError(f"{where}: {exc}") from None
    return recipes if any(r is not None for r in recipes.values()) else None


def with_qembedding(recipes: dict | None, qembedding: Any, where: str = "qembedding") -> dict | None:
    """``recipes`` (:func:`recipes_by_target`) with ``qembedding`` (``"8w"`` / ``"4w"``) in every
    quantized target's recipe (a recipe's own ``qembedding`` is replaced); None leaves them."""
    from lowering.quantize import QuantizeError, parse_recipe

    if qembedding is None:
        return recipes
    if not recipes:
        raise ManifestError(f"{where}: quantized embeddings come with a linear recipe: add 'quantize: 8da4w' "
                            "(or int8-dynamic)")
    try:
        return {t: None if r is None else parse_recipe({**r, "qembedding": qembedding}).to_dict()
                for t, r in recipes.items()}
    except QuantizeError as exc:
        raise ManifestError(f"{where}: {exc}") from None


def profiles_by_target(value: Any, targets: list[str] | tuple[str, ...], where: str = "runtime_ops") -> dict | None:
    """A ``runtime_ops`` setting as ``{target: profile or None}`` (None: every target has
    the default profile, all op sets).

    ``value``: None; op set names (``"portable,quantized"`` or a list) for every target;
    or per target ``{"portable": "portable", "xnnpack": None}`` (targets not named keep the
    default).  A profile comes back as its sets in canonical order, and the default one as
    None, so equal profiles give equal emit keys and the default keeps the old ones.
    """
    from lowering.stock_ops import DEFAULT_PROFILE

    if value is None:
        return None
    per_target = isinstance(value, Mapping)
    if per_target:
        stray = sorted(set(map(str, value)) - set(targets))
        if stray:
            raise ManifestError(f"{where}: names targets not lowered: {stray} (lowered: {list(targets)})")
    profiles = {t: (value.get(t) if per_target else value) for t in targets}
    profiles = {t: None if v is None else _profile(v, f"{where}{f' ({t})' if per_target else ''}")
                for t, v in profiles.items()}
    profiles = {t: None if p is None or tuple(p) == DEFAULT_PROFILE else p for t, p in profiles.items()}
    return profiles if any(p is not None for p in profiles.values()) else None


def external_by_target(value: Any, targets: list[str] | tuple[str, ...],
                       where: str = "external_weights") -> dict | None:
    """An ``external_weights`` setting as ``{target: True}`` of the targets whose weights go
    to a ``.ptd`` (None: none; then no stage key changes).

    ``value``: None / false; true (every target); a list of targets; ``{target: bool}``.
    """
    if value is None or value is False:
        return None
    if value is True:
        chosen = list(targets)
    elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        chosen = list(value)
    elif isinstance(value, Mapping) and all(isinstance(v, bool) for v in value.values()):
        chosen = [str(t) for t, on in value.items() if on]
    else:
        raise ManifestError(f"{where}: must be true, false, a list of targets or {{target: true|false}}, "
                            f"got {value!r}")
    stray = sorted(set(chosen) - set(targets))
    if stray:
        raise ManifestError(f"{where}: names targets not lowered: {stray} (lowered: {list(targets)})")
    return {t: True for t in targets if t in chosen} or None


def _profile(value: Any, where: str) -> list[str]:
    """Op set names (a comma list or a list of strings) as a canonical profile."""
    from lowering.stock_ops import DEFAULT_PROFILE, runtime_profile

    allowed = ", ".join(DEFAULT_PROFILE)
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ManifestError(f"{where}: expected op set names (a list or 'portable,quantized'), got {value!r}; "
                            f"allowed: {allowed}")
    names = [n.strip() for n in names if n.strip()]
    unknown = [n for n in names if n not in DEFAULT_PROFILE]
    if unknown or not names:
        what = f"unknown op set {unknown[0]!r}" if unknown else f"{value!r} names no op set"
        raise ManifestError(f"{where}: {what}; allowed: {allowed}")
    return list(runtime_profile(names))


def _threshold(where: str, key: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ManifestError(f"{where}: {key!r} must be a number, got {value!r}")
    if key == "max_error" and not 0 < value:
        raise ManifestError(f"{where}: 'max_error' must be positive, got {value!r}")
    return float(value)


def dynamic_shapes_option(text: str | None, spec: ModelSpec) -> Any:
    """The CLI's ``--dynamic-shapes JSON`` for ``spec``, validated and canonical (None: not given)."""
    if text is None:
        return None
    if spec.kind == "pt2":
        raise ManifestError("--dynamic-shapes is only for a factory; a .pt2 program carries its own")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ManifestError(f"--dynamic-shapes: not JSON: {exc}") from None
    return canonical_dynamic_shapes(doc, "--dynamic-shapes")


def canonical_dynamic_shapes(doc: Any, where: str) -> Any:
    """A ``dynamic_shapes`` document validated and in canonical JSON form (string dim
    indices, every dim's name, min and max), so equal specs give equal cache keys."""
    from lowering.dynamic import DynamicShapeError, dynamic_shapes_from_json, dynamic_shapes_to_json

    try:
        return dynamic_shapes_to_json(dynamic_shapes_from_json(doc, what=where), what=where)
    except DynamicShapeError as exc:
        raise ManifestError(str(exc)) from None


def _chain_targets(where: str, targets: Any) -> tuple[Any, dict[str, dict]]:
    """``[xnnpack, {name: android, backends: [vulkan, xnnpack]}]`` -> the names and each
    chain's ``{"backends": [...]}`` (merged into its options: lowering.targets.chain_of)."""
    if not isinstance(targets, list):
        return targets, {}
    names, chains = [], {}
    for target in targets:
        if isinstance(target, Mapping):
            if set(target) != {"name", "backends"} or not isinstance(target["name"], str):
                raise ManifestError(f"{where}: a chain target is {{name: NAME, backends: [BACKEND, ...]}}, "
                                    f"got {dict(target)}")
            chains[target["name"]] = {"backends": target["backends"]}
            target = target["name"]
        names.append(target)
    return names, chains


def _check_target(where: str, target: str, options: Mapping[str, Any] | None = None) -> None:
    try:
        check_target(target, options)
    except BackendError as exc:
        raise ManifestError(f"{where}: {exc}") from exc
