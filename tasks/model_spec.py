"""Model specs: the strings a fleet manifest or the CLI names models by.

* ``path/to/file.py:factory`` — a Python file; ``factory()`` returns ``(nn.Module, example_inputs)``,
  ``(nn.Module, example_inputs, dynamic_shapes)`` (torch.export's argument,
  ``torch.export.Dim`` objects each with a max; see :mod:`lowering.dynamic`), or
  ``{method_name: (nn.Module, example_inputs[, dynamic_shapes])}`` for a program of several methods
  (e.g. ``encode`` and ``decode`` wrappers over one model; see :func:`load_methods`).
  One model may also come as a mapping ``{"module": ..., "inputs": ...[, "dynamic_shapes": ...]
  [, "calibration": batches]}``: the only form that carries calibration data for the
  quantize stage (:mod:`tasks.calibration`).
  Methods that share mutable buffers (``prefill`` and ``decode`` over one KV cache)
  say so with ``factory.share_mutable_buffers = True`` (see ``lowering.lower_methods``).
  The file's directory is importable while it loads and while the factory runs,
  so a factory may ``import arch`` from a sibling ``arch.py``.
* ``package.module:factory`` — the same, from an importable module.
* ``<fsspec URL or path>.pt2`` — a program saved by ``torch.export.save``; read without
  running code (:mod:`lowering.untrusted`) unless the ``trust_pickle`` option is set.
* ``hf:<directory or hub id>`` — a Hugging Face model, with a task and options in the
  load options' ``"hf"`` entry (:mod:`tasks.hf_spec`): the methods of one program and
  its constant methods (``LoadedModel.constants``).

:func:`load_model` loads a spec and fingerprints it (:mod:`tasks.fingerprint`):
weights, code, attributes, example inputs and options.  The fingerprint is what
the export stage is keyed on, so new weights in a checkpoint the factory reads,
or an edited helper module, re-lower the model; the manifest's ``version`` is
only an extra salt.

Sibling modules a factory imports are tracked: one whose file changed since it
was imported, or that another factory's directory shadows (two models each
with their own ``arch.py``), is evicted from ``sys.modules`` before a factory
runs, so a long-lived process never lowers stale or foreign code.  The module of
a ``package.module`` spec is reloaded when its file changed since it was imported
(the fingerprint reads the file on disk: the code run must be the code keyed).

:func:`resolve_factory` imports a spec's module and finds its factory without
calling it: what a fleet manifest checks for every entry before any work.

Why one room: parsing a spec, loading it and fingerprinting it are one contract (what a
spec's ``key_text`` names is what loads, and what loads is what its fingerprint covers,
deferred hf: loads included); the hf:, calibration and .pt2 specifics live in
:mod:`tasks.hf_spec`, :mod:`tasks.calibration` and :mod:`lowering.untrusted`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import difflib
import hashlib
import importlib
import importlib.util
import sys
import threading
from pathlib import Path
from typing import Any

import fsspec
import torch

from lowering.dynamic import (
    DynamicShapeError,
    check_against_inputs,
    dynamic_shapes_from_json,
    dynamic_shapes_to_json,
)

from .fingerprint import Fingerprint, fingerprint_methods, fingerprint_module, fingerprint_pt2
from .torch_lock import TORCH_LOCK


class ModelSpecError(ValueError):
    """A model spec that cannot be parsed or loaded; the message names the spec."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    text: str
    kind: str  # "file", "module", "pt2" or "hf"
    location: str  # file path, module name or URL
    factory: str | None

    @classmethod
    def parse(cls, text: str) -> "ModelSpec":
        if not isinstance(text, str) or not text.strip():
            raise ModelSpecError(f"model spec must be a non-empty string, got {text!r}")
        text = text.strip()
        if text.startswith("hf:"):
            if not text[3:].strip():
                raise ModelSpecError(f"model spec {text!r}: expected 'hf:<model directory or hub id>'")
            return cls(text, "hf", text[3:].strip(), None)
        if text.endswith(".pt2"):
            return cls(text, "pt2", text, None)
        location, sep, factory = text.rpartition(":")
        if not sep or not location or not factory.isidentifier():
            raise ModelSpecError(
                f"model spec {text!r}: expected 'path/file.py:factory', 'package.module:factory' or a .pt2 URL"
            )
        if location.endswith(".py"):
            return cls(text, "file", location, factory)
        if all(part.isidentifier() for part in location.split(".")):
            return cls(text, "module", location, factory)
        raise ModelSpecError(f"model spec {text!r}: {location!r} is neither a .py file nor a module name")

    @property
    def key_text(self) -> str:
        """The spec as stage inputs carry it: a local file's path absolute and resolved,
        so ``examples/models.py:cnn`` and ``/abs/examples/models.py:cnn`` (or a symlink)
        give the same cache keys, and a stage retried from another directory finds it."""
        if self.kind == "file":
            return f"{Path(self.location).resolve()}:{self.factory}"
        if self.kind == "pt2" and "://" not in self.location:
            return str(Path(self.location).resolve())
        if self.kind == "hf" and Path(self.location).expanduser().is_dir():
            return f"hf:{Path(self.location).expanduser().resolve()}"
        return self.text

    @property
    def name(self) -> str:
        """A short default name: the factory, or the .pt2 file's stem."""
        if self.factory:
            return self.factory
        if self.kind == "hf":
            return Path(self.location.rstrip("/")).name or "hf-model"
        return Path(self.location.rsplit("/", 1)[-1]).stem


def check_spec(spec: ModelSpec, storage_options: dict | None = None, options: dict | None = None) -> None:
    """Raise ModelSpecError unless the spec's file, module or .pt2 can be found (an hf:
    model: its directory, and its task and options in ``options["hf"]``)."""
    try:
        if spec.kind == "hf":
            from lowering.errors import LoweringError

            from .hf_spec import check

            try:
                check(spec.location, options)
            except LoweringError as exc:
                raise _hf_error(spec, exc) from exc
        elif spec.kind == "pt2":
            fs, path = fsspec.core.url_to_fs(spec.location, **(storage_options or {}))
            if not fs.exists(path):
                raise ModelSpecError(f"model spec {spec.text!r}: cannot read {spec.location!r}: no such file")
        elif spec.kind == "file":
            if not Path(spec.location).is_file():
                raise ModelSpecError(f"model spec {spec.text!r}: cannot read {spec.location!r}: no such file")
        elif importlib.util.find_spec(spec.location) is None:
            raise ModelSpecError(f"model spec {spec.text!r}: module {spec.location!r} not found")
    except ModelSpecError:
        raise
    except Exception as exc:
        raise ModelSpecError(f"model spec {spec.text!r}: cannot read {spec.location!r}: {exc}") from exc


def resolve_factory(spec: ModelSpec) -> Any:
    """The spec's factory, imported but not called: its file exists (or its module is
    found), the module imports, and the attribute is callable.  Raises ModelSpecError
    naming the spec (with the closest factory name when the attribute is missing)."""
    if spec.kind in ("pt2", "hf"):
        raise ModelSpecError(f"model spec {spec.text!r} is a {_KIND_NAMES[spec.kind]}, not a factory")
    check_spec(spec)
    directory = Path(spec.location).resolve().parent if spec.kind == "file" else None
    with TORCH_LOCK, _importable(directory):
        return _factory_of(spec)[1]


def _factory_of(spec: ModelSpec) -> tuple[Any, Any]:
    """(the spec's Python module, its factory); the caller holds TORCH_LOCK with the
    factory's directory importable."""
    try:
        module = _import(spec)
    except ModelSpecError:
        raise
    except Exception as exc:
        raise ModelSpecError(f"model spec {spec.text!r}: cannot import: {type(exc).__name__}: {exc}") from exc
    factory = getattr(module, spec.factory, None)
    if factory is None:
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        close = difflib.get_close_matches(spec.factory, names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ModelSpecError(f"model spec {spec.text!r}: {spec.location} has no factory {spec.factory!r}{hint}")
    if not callable(factory):
        raise ModelSpecError(f"model spec {spec.text!r}: {spec.factory!r} in {spec.location} is a "
                             f"{type(factory).__name__}, not a factory (a function returning the model)")
    return module, factory


_KIND_NAMES = {"pt2": ".pt2 program", "hf": "Hugging Face model"}


@dataclasses.dataclass
class LoadedModel:
    """A loaded spec: the eager module and inputs (None for a .pt2) and its fingerprint.

    A spec of several methods has no module of its own: ``methods`` maps each
    method name (in program order) to that method's LoadedModel (its module,
    inputs and fingerprint, ``method`` set), and ``fingerprint`` covers them all.
    """

    spec: ModelSpec
    fingerprint: Fingerprint
    module: torch.nn.Module | None = None
    inputs: tuple[Any, ...] | None = None
    pt2: bytes | None = None
    methods: dict[str, "LoadedModel"] | None = None
    method: str | None = None
    #: torch.export's ``dynamic_shapes`` for the module: the factory's, or the
    #: ``dynamic_shapes`` option (JSON form) when given; None: static.
    dynamic_shapes: Any = None
    #: The methods share their mutable buffers (the factory's ``share_mutable_buffers``).
    share_mutable_buffers: bool = False
    #: Calibration data the factory returned (``"calibration"`` of its mapping), as it
    #: returned it: an iterable of input tuples or a callable (see :mod:`tasks.calibration`).
    calibration: Any = None
    #: Constant methods ``{name: value}`` of the program (an hf: model's metadata).
    constants: dict[str, Any] | None = None
    #: Export with torch.export's strict mode (the ``strict`` option).
    strict: bool = False
    #: A .pt2 loads with torch's pickle-running loader (the ``trust_pickle`` option).
    trust_pickle: bool = False
    #: Bytes of the model's weights (each tensor once), where known without loading it
    #: (an hf: model's weight files); else :meth:`weights_size` counts the modules'.
    weight_bytes: int | None = None

    def weights_size(self) -> int | None:
        """Bytes of the model's weights, each tensor once over its methods (None: a .pt2,
        whose weights are not counted).  What ``verify: auto`` chooses quick or full by."""
        if self.weight_bytes is not None:
            return self.weight_bytes
        modules = [m.module for m in self.methods.values()] if self.methods else [self.module]
        if any(m is None for m in modules):
            return None
        seen, total = set(), 0
        for module in modules:
            for tensor in [*module.parameters(), *module.buffers()]:
                key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
                if key not in seen:
                    seen.add(key)
                    total += tensor.numel() * tensor.element_size()
        return total


def load_model(spec: ModelSpec, options: dict | None = None, storage_options: dict | None = None,
               memo: Any = None) -> LoadedModel:
    """Load ``spec`` (run its factory, or read its .pt2) and fingerprint it.
    ``memo``: the artifact store that remembers an hf: model's description (:func:`tasks.hf_spec.describe`).

    ``options`` (export options and the manifest's ``version``) are part of the
    fingerprint.  ``options["dynamic_shapes"]`` (the JSON form of
    :func:`lowering.dynamic.dynamic_shapes_from_json`) replaces the factory's
    dynamic shapes.  Errors are :class:`ModelSpecError` naming the spec.
    """
    override = (options or {}).get("dynamic_shapes")
    if spec.kind == "hf":
        return _load_hf(spec, options, override, memo)
    if spec.kind == "pt2":
        if override is not None:
            raise ModelSpecError(f"model spec {spec.text!r}: a .pt2 program carries its own dynamic shapes; "
                                 "'dynamic_shapes' is only for a factory")
        data = read_pt2(spec, storage_options)
        trust = bool((options or {}).get("trust_pickle"))
        if not trust:
            check_pt2(spec, data)
        return LoadedModel(spec, fingerprint_pt2(data, options), pt2=data, trust_pickle=trust)
    with TORCH_LOCK:
        module, inputs, factory_module, dynamic_shapes, calibration = _run_factory(spec)
        if isinstance(module, dict):
            if override is not None:
                raise ModelSpecError(
                    f"model spec {spec.text!r} has several methods {sorted(module)}: the "
                    "dynamic_shapes option is for a model of one method"
                )
            share = _share_mutable_buffers(spec, getattr(factory_module, spec.factory))
            return _load_methods(spec, module, factory_module, options, share)
        dynamic_shapes = _dynamic_shapes(spec, module, inputs, dynamic_shapes, override)
        fp = _fingerprint(spec, module, inputs, factory_module, options, dynamic_shapes)
    return LoadedModel(spec, fp, module, inputs, dynamic_shapes=dynamic_shapes, calibration=calibration,
                       strict=bool((options or {}).get("strict")))


def _hf_error(spec: ModelSpec, exc: Exception) -> ModelSpecError:
    """lowering.hf's "hf:<source>: why" as "model spec 'hf:<source>': why"."""
    return ModelSpecError(f"model spec {spec.text!r}: {str(exc).removeprefix(f'hf:{spec.location}: ')}")


def _load_hf(spec: ModelSpec, options: dict | None, override: Any, memo: Any = None) -> LoadedModel:
    """An hf: model: always a model of methods (``forward`` alone for most tasks), with its
    constant methods; errors name the spec.  Only its files are hashed and its config read
    here (:func:`tasks.hf_spec.describe`): the weights load when a stage first uses a
    method's module (:class:`DeferredMethod`), so a run whose stages all hit the cache
    never loads them."""
    from lowering.errors import LoweringError

    from .hf_spec import describe

    if override is not None:
        raise ModelSpecError(f"model spec {spec.text!r}: an hf: model's dynamic shapes come with its task; "
                             "'dynamic_shapes' is only for a factory")
    try:
        with TORCH_LOCK:
            described, fingerprints, fingerprint = describe(spec.location, options, memo)
    except LoweringError as exc:
        raise _hf_error(spec, exc) from exc
    strict = bool((options or {}).get("strict"))
    load = HFLoad(spec, options, described)
    methods = {name: DeferredMethod(spec, fingerprints[name], name, load, strict) for name in described.method_names}
    return LoadedModel(spec, fingerprint, methods=methods, share_mutable_buffers=described.share_mutable_buffers,
                       constants=described.constants, strict=strict, weight_bytes=hf_weight_bytes(described.directory))


#: How many times this process loaded an hf: model's weights (:class:`HFLoad`): a fully
#: cached run leaves it as it was.
HF_LOADS = collections.Counter()


class HFLoad:
    """Loads an hf: model (``from_pretrained``) once, on first call, and checks that the
    program loaded is the one :func:`tasks.hf_spec.describe` described (its methods,
    constants and options: what the fingerprint was taken of)."""

    def __init__(self, spec: ModelSpec, options: dict | None, described: Any) -> None:
        self.spec, self.options, self.described = spec, options, described
        self._program = None
        self._lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        return self._program is not None

    def __call__(self) -> Any:
        """The loaded :class:`lowering.hf.HFProgram`."""
        from lowering.errors import LoweringError
        from lowering.hf import load_hf

        from .hf_spec import trust_pickle

        with TORCH_LOCK, self._lock:  # TORCH_LOCK first: a stage body holds it when it asks
            if self._program is None:
                hf = dict((self.options or {}).get("hf") or {})
                task = hf.pop("task", None)
                try:
                    with torch.random.fork_rng():
                        program = load_hf(self.spec.location, task, **hf,
                                          trust_pickle=trust_pickle(self.options))
                except LoweringError as exc:
                    raise _hf_error(self.spec, exc) from exc
                HF_LOADS[self.spec.key_text] += 1
                self._check(program)
                self._program = program
            return self._program

    def _check(self, program: Any) -> None:
        described = self.described
        got = (tuple(program.methods), program.constants, program.options)
        want = (tuple(described.method_names), described.constants, described.options)
        if got != want:
            raise ModelSpecError(f"model spec {self.spec.text!r}: the loaded model's program is not the one its "
                                 f"config described (methods, constants, options: {got} != {want}); "
                                 "its fingerprint would not be its own")


class DeferredMethod(LoadedModel):
    """One method of an hf: model whose ``module``, ``inputs`` and ``dynamic_shapes`` come
    from the model loaded on first use (:class:`HFLoad`, shared by the model's methods)."""

    def __init__(self, spec: ModelSpec, fingerprint: Fingerprint, method: str, load: HFLoad, strict: bool) -> None:
        # LoadedModel's other fields, set directly: its __init__ would assign the three below.
        self.__dict__.update(spec=spec, fingerprint=fingerprint, pt2=None, methods=None, method=method,
                             share_mutable_buffers=False, calibration=None, constants=None, strict=strict,
                             trust_pickle=False, weight_bytes=None)
        self.load = load

    module = property(lambda self: self.load().methods[self.method][0], doc="the method's module (loads the model)")
    inputs = property(lambda self: self.load().methods[self.method][1], doc="its example inputs (loads the model)")
    dynamic_shapes = property(lambda self: self.load().methods[self.method][2], doc="its dynamic shapes (loads it)")

    def __repr__(self) -> str:
        return f"DeferredMethod({self.spec.text!r}, method={self.method!r}, loaded={self.load.loaded})"


def hf_weight_bytes(directory: Path) -> int:
    """Bytes of an hf: model's weight files (what the verify mode is chosen by)."""
    from .fingerprint import is_hf_weights

    root = Path(directory)
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and is_hf_weights(p.name)
               and not any(part.startswith(".") for part in p.relative_to(root).parts))


def modules_loaded(loaded: LoadedModel) -> bool:
    """Whether the model's modules are in memory (False: an hf: model no stage has needed yet)."""
    return not any(isinstance(m, DeferredMethod) and not m.load.loaded for m in (loaded.methods or {}).values())


def _fingerprint(spec: ModelSpec, module: torch.nn.Module, inputs: tuple, factory_module: Any,
                 options: dict | None, dynamic_shapes: Any, method: str | None = None) -> Fingerprint:
    """:func:`fingerprint_module`, its failure a ModelSpecError naming the spec (and method)."""
    try:
        return fingerprint_module(module, inputs, factory_module=factory_module, options=options,
                                  dynamic_shapes=dynamic_shapes_to_json(dynamic_shapes))
    except Exception as exc:
        where = f"model spec {spec.text!r}" + (f": method {method!r}" if method else "")
        raise ModelSpecError(f"{where}: cannot fingerprint the model: {type(exc).__name__}: {exc}") from exc


def _dynamic_shapes(spec: ModelSpec, module: torch.nn.Module, inputs: tuple, dynamic_shapes: Any,
                    override: Any, method: str | None = None) -> Any:
    """The dynamic shapes to export with: the JSON ``override`` if given, else the
    factory's (of ``method``, for several); checked against forward's arguments and the
    example inputs."""
    try:
        if override is not None:
            dynamic_shapes = dynamic_shapes_from_json(override)
        else:
            dynamic_shapes_to_json(dynamic_shapes)  # every Dim has a max
        check_against_inputs(dynamic_shapes, module, inputs)
    except DynamicShapeError as exc:
        where = f"model spec {spec.text!r}" + (f": method {method!r}" if method else "")
        raise ModelSpecError(f"{where}: {exc}") from None
    return dynamic_shapes


def load_factory_model(spec: ModelSpec) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    """Import the spec's factory and call it; checks what it returns."""
    if spec.kind in ("pt2", "hf"):
        raise ModelSpecError(f"model spec {spec.text!r} is a {_KIND_NAMES[spec.kind]}, not a factory")
    with TORCH_LOCK:
        module, inputs, _, _, _ = _run_factory(spec)
    if isinstance(module, dict):
        raise ModelSpecError(f"model spec {spec.text!r} has several methods {sorted(module)}; "
                             "use load_methods")
    return module, inputs


def load_methods(spec: ModelSpec) -> dict[str, tuple[torch.nn.Module, tuple[Any, ...]]]:
    """The spec's methods, ``{name: (module, example_inputs)}`` in program order (name
    order); a factory returning ``(module, example_inputs)`` has the one method ``forward``."""
    if spec.kind == "pt2":
        raise ModelSpecError(f"model spec {spec.text!r} is a .pt2 program, not a factory")
    if spec.kind == "hf":
        raise ModelSpecError(f"model spec {spec.text!r} is a Hugging Face model: load it with load_model "
                             "and its task")
    with TORCH_LOCK:
        module, inputs, _, _, _ = _run_factory(spec)
    if isinstance(module, dict):
        return {name: (method, method_inputs) for name, (method, method_inputs, _) in module.items()}
    return {"forward": (module, inputs)}


def _share_mutable_buffers(spec: ModelSpec, factory: Any) -> bool:
    """A factory of several methods asks for shared mutable buffers (a KV cache that
    ``prefill`` writes and ``decode`` reads) with ``factory.share_mutable_buffers = True``."""
    share = getattr(factory, "share_mutable_buffers", False)
    if not isinstance(share, bool):
        raise ModelSpecError(f"model spec {spec.text!r}: {spec.factory}.share_mutable_buffers must be "
                             f"True or False, got {share!r}")
    return share


def _load_methods(spec: ModelSpec, methods: dict, factory_module: Any, options: dict | None,
                  share_mutable_buffers: bool = False) -> LoadedModel:
    """A LoadedModel of several methods: one per method (fingerprinted alone, so a method's
    export is keyed on its own module and inputs), and a fingerprint over them all."""
    loaded = {}
    for name, (module, inputs, dynamic_shapes) in methods.items():
        fp = _fingerprint(spec, module, inputs, factory_module, options, dynamic_shapes, name)
        loaded[name] = LoadedModel(spec, fp, module, inputs, method=name, dynamic_shapes=dynamic_shapes)
    fingerprint = fingerprint_methods({name: m.fingerprint for name, m in loaded.items()})
    return LoadedModel(spec, fingerprint, methods=loaded, share_mutable_buffers=share_mutable_buffers)


def _factory_methods(spec: ModelSpec, result: Any) -> dict[str, tuple[torch.nn.Module, tuple[Any, ...], Any]]:
    """Check a factory's ``{method_name: (nn.Module, example_inputs[, dynamic_shapes])}``;
    ``{name: (module, inputs, dynamic_shapes or None)}`` sorted by name."""
    from lowering.methods import MethodError, check_method_name

    if not result:
        raise ModelSpecError(f"model spec {spec.text!r}: factory returned an empty dict of methods")
    methods = {}
    for name in sorted(result, key=str):
        try:
            check_method_name(name, f"model spec {spec.text!r}")
        except MethodError as exc:
            raise ModelSpecError(str(exc)) from None
        value = result[name]
        where = f"model spec {spec.text!r}: method {name!r}"
        if not (isinstance(value, tuple) and len(value) in (2, 3) and isinstance(value[0], torch.nn.Module)):
            raise ModelSpecError(f"{where}: expected (nn.Module, example_inputs[, dynamic_shapes]), "
                                 f"got {_describe(value)}")
        module, inputs = value[:2]
        inputs = tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,)
        dynamic_shapes = value[2] if len(value) == 3 else None
        methods[name] = (module, inputs, _dynamic_shapes(spec, module, inputs, dynamic_shapes, None, name))
    return methods


def _describe(value: Any) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)} ({', '.join(type(v).__name__ for v in value)})"
    return type(value).__name__


def _run_factory(spec: ModelSpec) -> tuple[Any, tuple[Any, ...] | None, Any, Any, Any]:
    """(model, inputs, the factory's Python module, its dynamic shapes or None, its calibration
    data or None); the caller holds TORCH_LOCK.  For several methods:
    ({name: (module, inputs)}, None, module, None, None)."""
    directory = Path(spec.location).resolve().parent if spec.kind == "file" else None
    with _importable(directory):
        module, factory = _factory_of(spec)
        try:
            # Factories seed torch's global generator; concurrent ones (a fleet on
            # threads) would interleave and build different weights.  One at a
            # time, and the caller's generator state is left as it was.
            with torch.random.fork_rng():
                result = factory()
        except Exception as exc:
            raise ModelSpecError(f"model spec {spec.text!r}: factory raised {type(exc).__name__}: {exc}") from exc
    if isinstance(result, dict) and isinstance(result.get("module"), torch.nn.Module):
        result, calibration = _model_mapping(spec, result)
    else:
        calibration = None
    if isinstance(result, dict):  # several methods: ({name: (module, inputs)}, None, module, None, None)
        return _factory_methods(spec, result), None, module, None, None
    if not (isinstance(result, tuple) and len(result) in (2, 3) and isinstance(result[0], torch.nn.Module)):
        raise ModelSpecError(
            f"model spec {spec.text!r}: factory must return (nn.Module, example_inputs), "
            f"(nn.Module, example_inputs, dynamic_shapes), {{'module': ..., 'inputs': ..., "
            f"'dynamic_shapes': ..., 'calibration': ...}} or "
            f"{{method_name: (nn.Module, example_inputs)}}, got {type(result).__name__}"
        )
    model, inputs = result[:2]
    dynamic_shapes = result[2] if len(result) == 3 else None
    inputs = tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,)
    return model, inputs, module, dynamic_shapes, calibration


#: The keys of a factory's mapping form (one model): ``module`` and ``inputs`` are required.
MODEL_KEYS = ("module", "inputs", "dynamic_shapes", "calibration")


def _model_mapping(spec: ModelSpec, result: dict) -> tuple[tuple, Any]:
    """A factory's ``{"module", "inputs"[, "dynamic_shapes"][, "calibration"]}`` as
    ((module, inputs, dynamic_shapes), calibration)."""
    unknown = sorted(set(map(str, result)) - set(MODEL_KEYS))
    if unknown:
        raise ModelSpecError(f"model spec {spec.text!r}: factory returned unknown keys {unknown}; "
                             f"allowed: {list(MODEL_KEYS)}")
    if "inputs" not in result:
        raise ModelSpecError(f"model spec {spec.text!r}: factory returned no 'inputs' (the example inputs)")
    return (result["module"], result["inputs"], result.get("dynamic_shapes")), result.get("calibration")


#: Top-level modules imported from a factory's directory: name -> (file, sha256 when imported).
_SIBLINGS: dict[str, tuple[str, str]] = {}


@contextlib.contextmanager
def _importable(directory: Path | None):
    """``directory`` first on sys.path for the block, stale or shadowed siblings evicted first,
    and the siblings imported during the block recorded."""
    if directory is None:
        yield
        return
    _evict_siblings(directory)
    before = set(sys.modules)
    entry = str(directory)
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        try:
            sys.path.remove(entry)
        except ValueError:
            pass
        for name in set(sys.modules) - before:
            if "." in name:
                continue
            path = _sibling_file(sys.modules[name], directory)
            if path is not None:
                _SIBLINGS[name] = (path, _sha256_file(path))


def _sibling_file(mod: Any, directory: Path) -> str | None:
    path = getattr(mod, "__file__", None)
    if not path:
        return None
    p = Path(path).resolve()
    if p.parent == directory or (p.name == "__init__.py" and p.parent.parent == directory):
        return str(p)
    return None


def _evict_siblings(directory: Path) -> None:
    """Forget tracked sibling modules that changed on disk or that ``directory`` shadows."""
    for name, (path, digest) in list(_SIBLINGS.items()):
        shadow = next((c for c in (directory / f"{name}.py", directory / name / "__init__.py") if c.is_file()), None)
        shadowed = shadow is not None and str(shadow.resolve()) != path
        if shadowed or not Path(path).is_file() or _sha256_file(path) != digest:
            for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[loaded]
            del _SIBLINGS[name]


def _sha256_file(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return ""


def check_pt2(spec: ModelSpec, data: bytes) -> None:
    """ModelSpecError if the .pt2's bytes would run code to load
    (:func:`lowering.untrusted.check_pt2`: the message names the file and the entry).
    An archive that cannot be read at all is the export stage's error ("cannot load .pt2")."""
    from lowering.errors import UntrustedInputError
    from lowering.untrusted import Pt2Error, check_pt2 as check

    try:
        check(data, spec.text)
    except UntrustedInputError as exc:
        raise ModelSpecError(str(exc)) from None
    except Pt2Error:
        pass


def read_pt2(spec: ModelSpec, storage_options: dict | None = None) -> bytes:
    try:
        with fsspec.open(spec.location, "rb", **(storage_options or {})) as f:
            return f.read()
    except Exception as exc:
        raise ModelSpecError(f"model spec {spec.text!r}: cannot read: {exc}") from exc


#: Modules of ``package.module`` specs: name -> sha256 of their file when (re)imported.
_MODULE_FILES: dict[str, str] = {}


def _import(spec: ModelSpec):
    if spec.kind == "module":
        return _import_module(spec.location)
    path = Path(spec.location).resolve()
    if not path.is_file():
        raise ModelSpecError(f"model spec {spec.text!r}: file {spec.location!r} does not exist")
    name = "lowerflow_model_" + hashlib.sha256(str(path).encode()).hexdigest()[:16]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    module_spec.loader.exec_module(module)
    return module


def _import_module(name: str):
    """``importlib.import_module(name)``, reloaded when its file changed since lowerflow
    last imported it (a long-lived worker must run the code the fingerprint reads)."""
    module = importlib.import_module(name)
    path = getattr(module, "__file__", None)
    if not path:
        return module
    digest = _sha256_file(path)
    seen = _MODULE_FILES.get(name)
    if seen is not None and seen != digest:
        # Python trusts bytecode whose source has the same mtime (whole seconds) and
        # size: an edit within the second that kept the size would reload the old code.
        cached = getattr(module, "__cached__", None)
        if cached:
            Path(cached).unlink(missing_ok=True)
        importlib.invalidate_caches()
        module = importlib.reload(module)
    _MODULE_FILES[name] = digest
    return module


# --------------------------------------------------------------------------- live models

#: Models loaded by a running flow, by fingerprint digest: the export and verify
#: stages use them instead of running the factory again.  Entry -> (model, holders).
_LIVE: dict[str, list] = {}
_LIVE_LOCK = threading.Lock()


@contextlib.contextmanager
def holding(loaded: LoadedModel):
    """Make ``loaded`` what :func:`live_model` returns for its fingerprint during the block."""
    held = [loaded, *(loaded.methods or {}).values()]  # and each method, by its own fingerprint
    entries = []
    with _LIVE_LOCK:
        for item in held:
            # and by its structure digest (the export of a model with external weights: flows.weights_only)
            for digest in filter(None, (item.fingerprint.digest, item.fingerprint.structure_digest)):
                entry = _LIVE.setdefault(digest, [item, 0])
                entry[1] += 1
                entries.append((digest, entry))
    try:
        yield loaded
    finally:
        with _LIVE_LOCK:
            for digest, entry in entries:
                entry[1] -= 1
                if entry[1] <= 0:
                    _LIVE.pop(digest, None)


def live_model(model: str, fingerprint: str, options: dict | None = None) -> LoadedModel:
    """The loaded model whose fingerprint (or structure digest: :attr:`Fingerprint.structure_digest`)
    is ``fingerprint``: the one a running flow holds, else loaded again (a stage retried in another process).  If the model no
    longer has that fingerprint (its weights or code changed since the flow
    started), a ModelSpecError says so rather than lowering a different model
    under the old key."""
    with _LIVE_LOCK:
        entry = _LIVE.get(fingerprint)
    if entry is not None:
        return entry[0]
    spec = ModelSpec.parse(model)
    loaded = load_model(spec, options)
    for method in (loaded.methods or {}).values():  # a stage of one method of several
        if fingerprint in (method.fingerprint.digest, method.fingerprint.structure_digest):
            return method
    if fingerprint not in (loaded.fingerprint.digest, loaded.fingerprint.structure_digest):
        raise ModelSpecError(
            f"model spec {spec.text!r} changed while it was being lowered "
            f"(fingerprint {fingerprint[:12]} -> {loaded.fingerprint.digest[:12]}); run again"
        )
    return loaded
