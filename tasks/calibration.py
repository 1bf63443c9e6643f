"""Calibration data of the quantize stage: where it comes from, its digest, reading it again.

A static ``int8`` recipe observes activations on calibration batches (input
tuples like the example inputs).  They come from one of:

* the model's factory, returning a mapping instead of a tuple::

      def cnn():
          model = CNN()
          return {"module": model, "inputs": (torch.randn(1, 3, 32, 32),),
                  "calibration": [(torch.randn(1, 3, 32, 32),) for _ in range(16)]}

  (``calibration``: an iterable of input tuples, or a callable returning one);
* a spec in the manifest (``calibration:``) or on the CLI (``--calibration``):
  ``path/file.py:function`` / ``package.module:function`` returning such an
  iterable, or an fsspec URL of a safetensors file whose tensors are named
  ``<batch>.<input>`` (``0.0``, ``0.1``, ``1.0``, ...).  A pickle (``.pt``, ``.pkl``, ...)
  is refused: safetensors never runs code, a function spec runs the user's own.

:func:`calibration_digest` (blake3 over every batch's dtypes, shapes and bytes)
is what the quantize stage is keyed on: other calibration data re-quantizes,
the same data in another process or spelled another way does not.  The stage
body reads the batches again by :func:`calibration_batches`, which checks the
digest (data that changed while the model was being lowered is an error, never
a program keyed on other data).
"""

from __future__ import annotations

import re
import threading
from typing import Any, Iterable

import torch

from .model_spec import ModelSpec, ModelSpecError, live_model

#: ``source`` of calibration data that the model's factory returned.
FROM_FACTORY = "factory"

_SAFETENSORS_NAME = re.compile(r"^(\d+)\.(\d+)$")
#: Files that hold pickles: refused as calibration data (a pickle runs code when loaded).
PICKLE_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle", ".bin", ".ckpt")


class CalibrationError(ValueError):
    """Calibration data that cannot be used; the message names the model and source."""


Batches = list[tuple[torch.Tensor, ...]]


def as_batches(value: Any, where: str) -> Batches:
    """``value`` (an iterable of input tuples or tensors, or a callable returning one)
    as a list of input tuples; a CalibrationError naming ``where`` otherwise."""
    if callable(value) and not isinstance(value, torch.Tensor):
        try:
            value = value()
        except Exception as exc:
            raise CalibrationError(f"{where}: calibration callable raised {type(exc).__name__}: {exc}") from exc
    if isinstance(value, (torch.Tensor, str, bytes)) or not isinstance(value, Iterable):
        raise CalibrationError(f"{where}: calibration must be an iterable of input tuples (or a callable "
                               f"returning one), got {type(value).__name__}")
    batches: Batches = []
    for i, batch in enumerate(value):
        batch = tuple(batch) if isinstance(batch, (list, tuple)) else (batch,)
        bad = [type(t).__name__ for t in batch if not isinstance(t, torch.Tensor)]
        if bad:
            raise CalibrationError(f"{where}: calibration batch {i} holds {', '.join(bad)}, not only tensors")
        batches.append(tuple(t.detach() for t in batch))
    if not batches:
        raise CalibrationError(f"{where}: calibration data is empty")
    return batches


def calibration_digest(batches: Batches) -> str:
    """blake3 over every batch's tensors (dtype, shape, logical bytes), in order."""
    import blake3

    from lowering.serialize import canonical_json

    from .fingerprint import tensor_digest

    doc = [[[str(t.dtype), list(t.shape), tensor_digest(t)] for t in batch] for batch in batches]
    return blake3.blake3(canonical_json(doc)).hexdigest()


def read_calibration(source: str, where: str) -> Batches:
    """The batches of a ``calibration:`` spec (a factory-like function or a safetensors URL)."""
    if not isinstance(source, str) or not source.strip():
        raise CalibrationError(f"{where}: calibration must be a 'file.py:function', 'package.module:function' "
                               f"or a safetensors URL, got {source!r}")
    source = source.strip()
    _refuse_pickle(source, where)
    if source.endswith(".safetensors"):
        return _read_safetensors(source, where)
    try:
        spec = ModelSpec.parse(source)
        if spec.kind == "pt2":
            raise ModelSpecError(f"{source!r} is a .pt2 program")
        from .model_spec import resolve_factory

        function = resolve_factory(spec)
    except ModelSpecError as exc:
        raise CalibrationError(f"{where}: calibration {source!r}: {exc}") from None
    return as_batches(function, f"{where}: calibration {source!r}")


def check_calibration_source(source: str, where: str) -> str:
    """A ``calibration:`` spec checked without reading data (what a manifest checks before any
    work): a function spec resolves, a URL exists.  Returns the spec as stages carry it."""
    if not isinstance(source, str) or not source.strip():
        raise CalibrationError(f"{where}: 'calibration' must be a 'file.py:function', 'package.module:function' "
                               f"or a safetensors URL, got {source!r}")
    source = source.strip()
    _refuse_pickle(source, where)
    if source.endswith(".safetensors"):
        import fsspec

        try:
            fs, path = fsspec.core.url_to_fs(source)
            found = fs.exists(path)
        except Exception as exc:
            raise CalibrationError(f"{where}: calibration {source!r}: {type(exc).__name__}: {exc}") from None
        if not found:
            raise CalibrationError(f"{where}: calibration {source!r}: no such file")
        return source
    try:
        spec = ModelSpec.parse(source)
        if spec.kind == "pt2":
            raise ModelSpecError(f"{source!r} is a .pt2 program, not a function")
        from .model_spec import resolve_factory

        resolve_factory(spec)
    except ModelSpecError as exc:
        raise CalibrationError(f"{where}: calibration {source!r}: {exc}") from None
    return spec.key_text


def _refuse_pickle(source: str, where: str) -> None:
    """A pickle file is not calibration data: loading it would run its code."""
    if source.lower().endswith(PICKLE_SUFFIXES):
        raise CalibrationError(f"{where}: calibration {source!r} is a pickle; lowerflow reads calibration data "
                               "without running code: a safetensors file (tasks.calibration.save_calibration "
                               "writes one) or a 'file.py:function'")


def _read_safetensors(url: str, where: str) -> Batches:
    import fsspec
    from safetensors.torch import load as load_safetensors

    try:
        with fsspec.open(url, "rb") as f:
            tensors = load_safetensors(f.read())
    except Exception as exc:
        raise CalibrationError(f"{where}: calibration {url!r}: cannot read: {type(exc).__name__}: {exc}") from None
    grid: dict[int, dict[int, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _SAFETENSORS_NAME.match(name)
        if match is None:
            raise CalibrationError(f"{where}: calibration {url!r}: tensor {name!r} is not named '<batch>.<input>'")
        grid.setdefault(int(match[1]), {})[int(match[2])] = tensor
    batches = []
    for b in range(len(grid)):
        if b not in grid or sorted(grid[b]) != list(range(len(grid[b]))):
            raise CalibrationError(f"{where}: calibration {url!r}: batches and inputs must be numbered from 0 "
                                   f"without gaps (batch {b})")
        batches.append(tuple(grid[b][i] for i in range(len(grid[b]))))
    if not batches:
        raise CalibrationError(f"{where}: calibration {url!r} holds no tensors")
    return batches


def save_calibration(batches: Iterable[Any], url: str) -> None:
    """Write batches as the safetensors file :func:`read_calibration` reads."""
    import fsspec
    from safetensors.torch import save as save_safetensors

    tensors = {f"{b}.{i}": t.contiguous() for b, batch in enumerate(as_batches(batches, url)) for i, t in enumerate(batch)}
    with fsspec.open(url, "wb") as f:
        f.write(save_safetensors(tensors))


#: Batches read in this process, by digest: the quantize stage does not read them twice.
_LIVE: dict[str, Batches] = {}
_LIVE_LOCK = threading.Lock()


def remember(batches: Batches) -> str:
    """Keep ``batches`` for :func:`calibration_batches` in this process; returns their digest."""
    digest = calibration_digest(batches)
    with _LIVE_LOCK:
        _LIVE[digest] = batches
    return digest


def calibration_batches(digest: str, source: str, model: str, fingerprint: str, options: dict | None = None) -> Batches:
    """The batches whose digest is ``digest``: kept in this process, else read again from
    ``source`` (:data:`FROM_FACTORY`: the model's factory, found by ``model`` and its
    ``fingerprint``).  Data whose digest changed is a CalibrationError."""
    with _LIVE_LOCK:
        batches = _LIVE.get(digest)
    if batches is not None:
        return batches
    if source == FROM_FACTORY:
        loaded = live_model(model, fingerprint, options)
        if loaded.calibration is None:
            raise CalibrationError(f"model spec {model!r}: the factory no longer returns calibration data")
        batches = as_batches(loaded.calibration, f"model spec {model!r}")
    else:
        batches = read_calibration(source, f"model spec {model!r}")
    if calibration_digest(batches) != digest:
        raise CalibrationError(f"model spec {model!r}: calibration data {source!r} changed while the model was "
                               "being lowered; run again")
    with _LIVE_LOCK:
        _LIVE[digest] = batches
    return batches
