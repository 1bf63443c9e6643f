"""Lowering targets: a name for "what to delegate, to which backend".

* ``portable`` — nothing delegated; every op runs on the runtime's portable kernels.
* a backend name (``reference``, ``xnnpack``, ``ReferenceBackend``, ``XnnpackBackend``,
  or any backend registered in the ``lowerflow.backends`` entry-point group or defined
  as a ``BackendDetails`` subclass) — partitioned by the backend's
  ``partitioner(**options)`` classmethod.  ``xnnpack`` programs run on ExecuTorch's
  XNNPACK backend (fp32).  ``openvino``, ``vulkan``, ``coreml``, ``ethos-u``, ``qnn``:
  ExecuTorch's own backends, from the optional plugin ``lowering.backends.executorch``
  (a backend's ``check_available()`` says in one line what to install).
* a chain: options ``{"backends": ["vulkan", "xnnpack"], "vulkan": {...}}`` under any
  name (``-t android=vulkan,xnnpack``) — each backend's partitioner takes what it can
  of what the ones before it left (:class:`~lowering.partition.ChainPartitioner`).
"""

from __future__ import annotations

import difflib
from importlib import metadata
from typing import Any, Mapping

from .errors import BackendError
from .delegation import ENTRY_POINT_GROUP, UnknownBackendError, find_backend
from .partition import ChainPartitioner, Partitioner

PORTABLE = "portable"
#: The options key that makes a target a chain of backends.
BACKENDS = "backends"


def target_names() -> list[str]:
    """The target names users type: ``portable``, then every backend registered in the
    ``lowerflow.backends`` entry-point group (``reference``, ``xnnpack``, plugins') by name."""
    return [PORTABLE, *sorted({e.name for e in metadata.entry_points(group=ENTRY_POINT_GROUP)} - {PORTABLE})]


def check_target(target: str, options: Mapping[str, Any] | None = None) -> None:
    """Raise BackendError unless ``target`` is ``portable`` or names a backend that can
    lower here (its ``check_available()``: a plugin's missing extra or SDK), or ``options``
    make it a chain of such backends; an unknown one lists :func:`target_names` with the
    closest as a suggestion."""
    chain = chain_of(target, options)
    if chain is not None:
        for backend, _ in chain:
            check_target(backend)
        return
    if target == PORTABLE:
        return
    try:
        backend = find_backend(target)
    except UnknownBackendError:
        names = target_names()
        close = difflib.get_close_matches(target, names, n=1) or difflib.get_close_matches(
            target.lower(), names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise BackendError(f"unknown target {target!r}{hint} (targets: {', '.join(names)})") from None
    check = getattr(backend, "check_available", None)
    if check is not None:
        check()


def chain_of(target: str, options: Mapping[str, Any] | None) -> list[tuple[str, dict]] | None:
    """``[(backend, its options), ...]`` when ``options`` make ``target`` a chain, else None.

    ``{"backends": ["vulkan", "xnnpack"], "vulkan": {"force_fp16": True}}`` ->
    ``[("vulkan", {"force_fp16": True}), ("xnnpack", {})]``.
    """
    if not options or BACKENDS not in options:
        return None
    backends = options[BACKENDS]
    if isinstance(backends, str):
        backends = [b for b in backends.split(",") if b]
    if not isinstance(backends, (list, tuple)) or not backends or not all(isinstance(b, str) for b in backends):
        raise BackendError(f"target {target!r}: 'backends' must be a non-empty list of backend names")
    if len(set(backends)) != len(backends):
        raise BackendError(f"target {target!r}: 'backends' lists a backend twice: {list(backends)}")
    if PORTABLE in backends:
        raise BackendError(f"target {target!r}: {PORTABLE!r} is not a backend; what no backend takes runs "
                           "on portable kernels anyway")
    stray = sorted(set(options) - {BACKENDS} - set(backends))
    if stray:
        raise BackendError(f"target {target!r}: options {stray} name no backend of its chain {list(backends)}")
    for backend in backends:
        if not isinstance(options.get(backend, {}), Mapping):
            raise BackendError(f"target {target!r}: options of {backend!r} must be a mapping")
    return [(b, dict(options.get(b) or {})) for b in backends]


def backend_versions(target: str) -> dict[str, str] | None:
    """The compiler versions a backend's compiles depend on (its ``compiler_versions()``),
    for the preprocess key; None for a backend without them (lowerflow's own)."""
    versions = getattr(find_backend(target), "compiler_versions", None)
    return dict(versions()) if versions is not None else None


def verify_tolerance(target: str, options: Mapping[str, Any] | None = None) -> float | None:
    """The absolute / relative tolerance ``target``'s programs are verified with (its backend's
    ``verify_tolerance(options)``: a reduced-precision compile); None: fp32's default."""
    chain = chain_of(target, options)
    if chain is not None:
        found = [t for t in (verify_tolerance(b, o) for b, o in chain) if t is not None]
        return max(found) if found else None
    if target == PORTABLE:
        return None
    tolerance = getattr(find_backend(target), "verify_tolerance", None)
    return tolerance(dict(options or {})) if tolerance is not None else None


def partitioner_for(target: str, options: Mapping[str, Any] | None = None) -> Partitioner | None:
    """The partitioner of ``target`` (None for ``portable``; a :class:`ChainPartitioner` for a
    chain, :func:`chain_of`); a clear error for unknown targets."""
    chain = chain_of(target, options)
    if chain is not None:
        return ChainPartitioner([partitioner_for(b, o) for b, o in chain], names=[b for b, _ in chain])
    if target == PORTABLE:
        if options:
            raise BackendError(f"target {PORTABLE!r} takes no options, got {sorted(options)}")
        return None
    check_target(target)
    backend = find_backend(target)
    make = getattr(backend, "partitioner", None)
    if make is None:
        raise BackendError(
            f"target {target!r}: backend {backend.__name__} has no partitioner() classmethod, "
            "so it can only lower whole programs"
        )
    try:
        return make(**dict(options or {}))
    except TypeError as exc:
        raise BackendError(f"target {target!r}: bad options {dict(options or {})}: {exc}") from exc


def keep_for(target: str, options: Mapping[str, Any] | None = None) -> dict | None:
    """What stage 1 needs to export ``target``'s own program, whose partitioner keeps ops whole
    (``ops_to_not_decompose``, :mod:`lowering.export.kept`) or constants unfolded
    (``fold_constants`` False): ``{"target", "options", "versions"}``
    (the versions of its backends' compilers: a new ExecuTorch may keep other ops); None for a
    target whose partitioners keep none (it shares the model's one export)."""
    partitioner = partitioner_for(target, options)
    steps = partitioner.partitioners if isinstance(partitioner, ChainPartitioner) else (partitioner,)
    keeping = [p for p in steps if p is not None and (not p.fold_constants
               or type(p).ops_to_not_decompose is not Partitioner.ops_to_not_decompose)]
    if not keeping:
        return None
    return {"target": target, "options": dict(options or {}), "versions": compilers_of(target, options)}


def compilers_of(target: str, options: Mapping[str, Any] | None) -> dict[str, dict | None]:
    """``{backend: its compiler versions}`` (:func:`backend_versions`) of ``target``'s backends
    (a chain's, in order)."""
    chain = chain_of(target, options)
    return {b: backend_versions(b) for b in ([b for b, _ in chain] if chain is not None else [target])}


def quantizer_for(target: str, options: Mapping[str, Any] | None, recipe: Any) -> dict | None:
    """What the quantize stage needs to quantize ``target``'s program with its backend's own PT2E
    quantizer (:meth:`~lowering.partition.Partitioner.quantizer`: Ethos-U's is Arm's
    ``EthosUQuantizer``, for ``int8``): ``{"target", "options", "quantizer", "versions"}`` (its class
    and the versions of its backends' compilers: a new ExecuTorch may annotate otherwise); None when the
    target quantizes with lowerflow's recipe (every target but those, ``portable`` included)."""
    if target == PORTABLE or recipe is None:
        return None
    from .quantize import parse_recipe

    partitioner = partitioner_for(target, options)
    quantizer = partitioner.quantizer(parse_recipe(recipe)) if partitioner is not None else None
    if quantizer is None:
        return None
    return {"target": target, "options": dict(options or {}),
            "quantizer": f"{type(quantizer).__module__}.{type(quantizer).__qualname__}",
            "versions": compilers_of(target, options)}
