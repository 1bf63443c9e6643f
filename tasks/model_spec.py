"""Model specs: the strings a fleet manifest or the CLI names models by.

* ``path/to/file.py:factory`` — a Python file; ``factory()`` returns ``(nn.Module, example_inputs)``.
* ``package.module:factory`` — the same, from an importable module.
* ``<fsspec URL or path>.pt2`` — a program saved by ``torch.export.save``.

:func:`source_digest` is what the export stage's cache key uses for the model:
the sha256 of the file that defines it (the ``.py`` file, the module's source
file, or the ``.pt2`` bytes).  A factory that reads other files is not tracked
beyond its own file: give the fleet entry a ``version`` to force a re-export.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import sys
import threading
from pathlib import Path
from typing import Any

import fsspec
import torch


_FACTORY_LOCK = threading.RLock()


class ModelSpecError(ValueError):
    """A model spec that cannot be parsed or loaded; the message names the spec."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    text: str
    kind: str  # "file", "module" or "pt2"
    location: str  # file path, module name or URL
    factory: str | None

    @classmethod
    def parse(cls, text: str) -> "ModelSpec":
        if not isinstance(text, str) or not text.strip():
            raise ModelSpecError(f"model spec must be a non-empty string, got {text!r}")
        text = text.strip()
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
    def name(self) -> str:
        """A short default name: the factory, or the .pt2 file's stem."""
        if self.factory:
            return self.factory
        return Path(self.location.rsplit("/", 1)[-1]).stem


def source_digest(spec: ModelSpec, storage_options: dict | None = None) -> str:
    """sha256 of the model's defining source (see module docstring)."""
    try:
        if spec.kind == "pt2":
            with fsspec.open(spec.location, "rb", **(storage_options or {})) as f:
                data = f.read()
        elif spec.kind == "file":
            data = Path(spec.location).read_bytes()
        else:
            module_spec = importlib.util.find_spec(spec.location)
            if module_spec is None or module_spec.origin is None:
                raise ModelSpecError(f"model spec {spec.text!r}: module {spec.location!r} not found")
            data = Path(module_spec.origin).read_bytes()
    except ModelSpecError:
        raise
    except Exception as exc:
        raise ModelSpecError(f"model spec {spec.text!r}: cannot read {spec.location!r}: {exc}") from exc
    return hashlib.sha256(data).hexdigest()


def load_factory_model(spec: ModelSpec) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    """Import the spec's factory and call it; checks what it returns."""
    if spec.kind == "pt2":
        raise ModelSpecError(f"model spec {spec.text!r} is a .pt2 program, not a factory")
    try:
        module = _import(spec)
        factory = getattr(module, spec.factory)
    except ModelSpecError:
        raise
    except Exception as exc:
        raise ModelSpecError(f"model spec {spec.text!r}: cannot import: {type(exc).__name__}: {exc}") from exc
    try:
        # Factories seed torch's global generator; concurrent ones (a fleet on
        # threads) would interleave and build different weights.  One at a
        # time, and the caller's generator state is left as it was.
        with _FACTORY_LOCK, torch.random.fork_rng():
            result = factory()
    except Exception as exc:
        raise ModelSpecError(f"model spec {spec.text!r}: factory raised {type(exc).__name__}: {exc}") from exc
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module)):
        raise ModelSpecError(
            f"model spec {spec.text!r}: factory must return (nn.Module, example_inputs), got {type(result).__name__}"
        )
    model, inputs = result
    return model, tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,)


def read_pt2(spec: ModelSpec, storage_options: dict | None = None) -> bytes:
    try:
        with fsspec.open(spec.location, "rb", **(storage_options or {})) as f:
            return f.read()
    except Exception as exc:
        raise ModelSpecError(f"model spec {spec.text!r}: cannot read: {exc}") from exc


def _import(spec: ModelSpec):
    if spec.kind == "module":
        return importlib.import_module(spec.location)
    path = Path(spec.location).resolve()
    if not path.is_file():
        raise ModelSpecError(f"model spec {spec.text!r}: file {spec.location!r} does not exist")
    name = "lowerflow_model_" + hashlib.sha256(str(path).encode()).hexdigest()[:16]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    module_spec.loader.exec_module(module)
    return module
