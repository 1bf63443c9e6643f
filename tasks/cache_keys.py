"""Cache keys of lowering stages: what a stage's key is computed from, and how.

Owns the key document and its hash; :class:`tasks.cache.StageCachePolicy` (the
Prefect cache policy of every stage) asks it for keys.  A stage's key is the sha256 of
canonical JSON of

* the stage name and stage version (bump the version when the stage's code changes),
* every task parameter, with each :class:`~tasks.store.ArtifactRef` replaced by its
  sha256 (content, not location) and everything else as canonical JSON,
* the torch and lowerflow versions, a digest of lowerflow's own source, and the
  versions of distributions that register backends (:func:`environment_versions`).

It is never keyed on torch objects (a parameter that is not JSON or an ArtifactRef
is an error unless listed in ``ignore``), on run ids or on source code, so the
same inputs give the same key in every process and flow run.  Nor on where locks
live (:mod:`tasks.locks`): that does not change what a stage computes.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import importlib.metadata
import json
import math
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

import torch

from .store import ArtifactRef

#: Bumped when the key document changes shape (invalidates every cached stage).
KEY_FORMAT = 1


class CacheKeyError(TypeError):
    """A stage parameter cannot be part of a cache key (names the parameter)."""


def key_document(stage: str, version: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """What a stage's key hashes: stage, version, parameters (refs as digests), versions."""
    return {
        "key_format": KEY_FORMAT,
        "stage": stage,
        "stage_version": str(version),
        "inputs": {k: key_json(v, f"stage {stage!r} parameter {k!r}") for k, v in params.items()},
        **environment_versions(),
    }


def stage_key(stage: str, document: Mapping[str, Any]) -> str:
    """The cache key of a key document: ``<stage>-<sha256 hex of its canonical JSON>``."""
    digest = hashlib.sha256(_canonical(document)).hexdigest()
    return f"{_slug(stage)}-{digest}"


@lru_cache(maxsize=1)
def environment_versions() -> dict[str, str]:
    """What every key includes besides the stage's own inputs: the code that computes it.

    * torch's and lowerflow's versions;
    * ``lowerflow_source``: a digest of lowerflow's own compiler and stage code (every
      ``.py`` and ``.fbs`` file of ``lowering/`` and ``tasks/``), so an edited pass
      never serves a program cached by the code before it, version bump or not;
    * the distributions that register backends (``lowerflow.backends`` entry points),
      ``name==version``: an upgraded third-party backend re-lowers what it delegates.
    """
    try:
        lowerflow = importlib.metadata.version("lowerflow")
    except importlib.metadata.PackageNotFoundError:
        lowerflow = "unknown"
    backends = sorted({
        f"{ep.dist.name}=={ep.dist.version}"
        for ep in importlib.metadata.entry_points(group="lowerflow.backends")
        if ep.dist is not None and ep.dist.name != "lowerflow"
    })
    return {
        "torch": torch.__version__,
        "lowerflow": lowerflow,
        "lowerflow_source": source_digest(),
        **({"backend_distributions": ",".join(backends)} if backends else {}),
    }


def source_digest() -> str:
    """sha256 over the relative paths and bytes of lowerflow's ``lowering`` and ``tasks`` sources."""
    digest = hashlib.sha256()
    for package, path in source_files():
        digest.update(f"{package.name}/{path.relative_to(package).as_posix()}\0".encode())
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def source_files() -> list[tuple[Path, Path]]:
    """(package directory, file) of every source :func:`source_digest` reads, in order."""
    import lowering

    return [
        (package, path)
        for package in (Path(lowering.__file__).parent, Path(__file__).parent)  # lowering/, tasks/
        for path in sorted(p for p in package.rglob("*") if p.suffix in (".py", ".fbs") and p.is_file())
    ]


def key_json(value: Any, where: str = "value") -> Any:
    """``value`` as canonical-JSON-ready data; ArtifactRefs become their digest.

    Accepts None, bool, int, finite float, str, ArtifactRef, Enum, dataclasses,
    and lists/tuples/dicts (str keys) of those.  Anything else (tensors, modules,
    programs) raises :class:`CacheKeyError` naming ``where``.
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CacheKeyError(f"{where}: non-finite float {value!r} cannot be a cache key")
        return value
    if isinstance(value, ArtifactRef):
        return {"artifact": value.sha256}
    if isinstance(value, enum.Enum):
        return key_json(value.value, where)
    if isinstance(value, (list, tuple)):
        return [key_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise CacheKeyError(f"{where}: dict key {k!r} is not a string")
            out[k] = key_json(v, f"{where}[{k!r}]")
        return out
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return {"dataclass": type(value).__qualname__, "fields": key_json(fields, where)}
    raise CacheKeyError(
        f"{where}: cannot key a cache on a {type(value).__module__}.{type(value).__qualname__}; "
        "pass an ArtifactRef (content digest) or JSON data, or list the parameter in ignore="
    )


def _canonical(obj: Any) -> bytes:
    """Canonical JSON bytes (sorted keys, no spaces, ASCII): what keys are hashed from."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "_", text) or "stage"
