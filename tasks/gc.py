"""Garbage collection of an artifact store: mark what is in use, sweep what is old and unused.

The rule (what ``lowerflow gc STORE [--keep-days N] [--dry-run]`` removes):

* **Kept, always**: everything under ``outputs/`` (published ``.pte`` files, manifests,
  pictures, ``fleet.json``) and everything those manifests reach: each stage record
  a model manifest names by its cache key (``stages[*].key``), the artifacts that
  record's result names, and for program manifests every blob they list.  So the
  latest lowering of every published model stays fully cached: tonight's run of an
  unchanged model is still all cache hits.
* **Kept while recent**: any object, cache record or quarantined file modified less
  than ``keep_days`` ago (default 7), and everything a recent cache record reaches
  (a running flow's records, not yet published, may name old weight blobs).  On a
  local store, storing bytes that are already there refreshes the object's time.
  A running flow only reads objects it wrote during its run or found through a
  cache record; both are kept unless the run, or the cache record it hit, is older
  than ``keep_days``.  So: never set ``keep_days`` below your longest run.  (A flow
  that does find an object gone treats the cached stage as a miss and recomputes
  it; see :class:`tasks.cache.StageCachePolicy`.)
* **Removed**: objects and cache records that are neither, and quarantined objects
  older than ``keep_days``.  An object kept as a window of a bigger one (``windows/``:
  a weight blob inside an emitted ``.pte``) counts as an object, and keeps that bigger
  object while it is in use; one kept as a range of a file outside the store (an hf:
  checkpoint's weights) counts as an object too (its window goes, never the file).  Records go before objects, so no record is ever
  left naming a removed object.  The record of a check of an object now gone
  (``checked/``: :mod:`tasks.store`, "Checked objects") goes too, and a memo (``memo/``:
  an hf: model's remembered description) unused for ``keep_days`` (a hit refreshes it).

Lock files are never touched (they belong to running stages, and a dead holder's
lock is cleared by the lock manager).  To release a model that is no longer
lowered, delete its ``outputs/<model>/`` first.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import posixpath
from typing import Any, Iterator

from lowering.serialize import manifest_blobs

from .cache import records_location
from .store import MANIFEST_KINDS, ArtifactRef, ArtifactStore

#: Default age (days) under which nothing is removed.
KEEP_DAYS = 7.0
#: Kinds of objects that name no further objects (everything else is a program
#: manifest or a JSON document that may).
_LEAF_KINDS = frozenset({"blob", "pte", "processed", "named_data", "named"})
_REF_TAG = "__lowerflow_artifact__"


@dataclasses.dataclass
class GCReport:
    """What a collection found and removed (or would remove, in a dry run)."""

    store: str
    dry_run: bool
    keep_days: float
    roots: int = 0  # published manifests read
    live_records: int = 0
    live_objects: int = 0
    removed_records: list[str] = dataclasses.field(default_factory=list)
    removed_objects: list[str] = dataclasses.field(default_factory=list)
    removed_quarantine: list[str] = dataclasses.field(default_factory=list)
    freed_bytes: int = 0
    kept_recent: int = 0
    missing: list[str] = dataclasses.field(default_factory=list)  # referenced but absent

    def summary(self) -> str:
        verb = "would remove" if self.dry_run else "removed"
        return (
            f"{self.store}: {verb} {len(self.removed_objects)} objects, {len(self.removed_records)} cache records, "
            f"{len(self.removed_quarantine)} quarantined files ({self.freed_bytes:,} bytes); "
            f"kept {self.live_objects} objects and {self.live_records} records in use by {self.roots} "
            f"published manifests, and {self.kept_recent} younger than {self.keep_days:g} days"
        )


def collect(store: ArtifactStore, *, keep_days: float = KEEP_DAYS, dry_run: bool = False,
            now: datetime.datetime | None = None) -> GCReport:
    """Mark from the published outputs, then sweep old unmarked records, objects and quarantine."""
    if keep_days < 0:
        raise ValueError(f"keep_days must be >= 0, got {keep_days}")
    now = now or datetime.datetime.now(datetime.timezone.utc)
    cutoff = now - datetime.timedelta(days=keep_days)
    report = GCReport(store.url, dry_run, keep_days)
    records_fs, records_dir = records_location(store)

    live_keys, live_objects = mark(store, records_fs, records_dir, report, cutoff)
    report.live_records, report.live_objects = len(live_keys), len(live_objects)

    for path in _files(records_fs, records_dir):
        key = posixpath.basename(path)
        if key in live_keys:
            continue
        if _modified(records_fs, path) >= cutoff:
            report.kept_recent += 1
            continue
        report.removed_records.append(key)
        if not dry_run:
            records_fs.rm_file(path)

    live_objects |= window_containers(store, live_objects)
    for directory in ("objects", "windows"):  # a window is an object kept as a range of another
        for path in _files(store.fs, f"{store.root}/{directory}"):
            digest = "".join(path.rsplit("/", 2)[-2:])  # objects/ab/cdef... -> abcdef...
            if digest in live_objects:
                continue
            if _modified(store.fs, path) >= cutoff:
                report.kept_recent += 1
                continue
            report.removed_objects.append(digest)
            report.freed_bytes += int(store.fs.size(path))
            if not dry_run:
                store.fs.rm_file(path)

    if not dry_run:  # the record of a check of an object now gone (tasks/store.py, "Checked objects")
        for path in _files(store.fs, f"{store.root}/checked"):
            if not store.has("".join(path.rsplit("/", 2)[-2:])):
                store.fs.rm_file(path)

    for path in _files(store.fs, f"{store.root}/memo"):  # remembered descriptions (tasks/store.py): remade on a miss
        if _modified(store.fs, path) < cutoff:
            report.removed_records.append(f"memo/{posixpath.basename(path)}")
            if not dry_run:
                store.fs.rm_file(path)

    for path in _files(store.fs, f"{store.root}/quarantine"):
        if _modified(store.fs, path) < cutoff:
            report.removed_quarantine.append(posixpath.basename(path))
            report.freed_bytes += int(store.fs.size(path))
            if not dry_run:
                store.fs.rm_file(path)
    return report


def mark(store: ArtifactStore, records_fs, records_dir: str, report: GCReport,
         cutoff: datetime.datetime) -> tuple[set[str], set[str]]:
    """(cache keys, object digests) reachable from the manifests under ``outputs/`` and
    from cache records younger than ``cutoff`` (a running flow's, not yet published)."""
    keys: set[str] = set()
    objects: set[str] = set()
    pending: list[ArtifactRef] = []
    for path in _files(records_fs, records_dir):
        if _modified(records_fs, path) >= cutoff:
            try:
                pending.extend(_record_refs(records_fs.cat_file(path)))
            except (ValueError, OSError):
                pass
    for path in _files(store.fs, f"{store.root}/outputs"):
        if not path.endswith(".json"):
            continue
        try:
            doc = json.loads(store.fs.cat_file(path))
        except (ValueError, OSError):
            continue
        report.roots += 1
        for key in _stage_keys(doc):
            if key in keys:
                continue
            keys.add(key)
            record = f"{records_dir}/{key}"
            try:
                pending.extend(_record_refs(records_fs.cat_file(record)))
            except FileNotFoundError:
                report.missing.append(f"record {key}")
        pending.extend(_refs_in(doc))
    while pending:
        ref = pending.pop()
        if ref.sha256 in objects or store._output_name(ref.uri) is not None:
            continue
        objects.add(ref.sha256)
        if ref.kind in _LEAF_KINDS:
            continue
        try:
            data = store.read_object(ref.sha256, what=f"{ref.kind} object")
        except Exception:
            report.missing.append(f"{ref.kind} {ref.sha256}")
            continue
        if ref.kind in MANIFEST_KINDS:
            objects.update(manifest_blobs(data))
        else:
            try:
                pending.extend(_refs_in(json.loads(data)))
            except ValueError:
                pass
    return keys, objects


def window_containers(store: ArtifactStore, live: set[str]) -> set[str]:
    """The objects that live objects kept as windows are ranges of (ArtifactStore.keep_as_windows):
    kept while such a window is in use, so a window never outlives what it reads."""
    containers = set()
    for path in _files(store.fs, f"{store.root}/windows"):
        digest = "".join(path.rsplit("/", 2)[-2:])
        if digest in live:
            window = store.window(digest)
            if window is not None and "object" in window:  # a file window's file is not the store's
                containers.add(str(window["object"]))
    return containers


def _stage_keys(doc: Any) -> Iterator[str]:
    """Every ``"key"`` of a stage record in a model manifest (``targets.*.stages[*]``)."""
    if isinstance(doc, dict):
        for target in (doc.get("targets") or {}).values() if isinstance(doc.get("targets"), dict) else ():
            for record in (target or {}).get("stages") or ():
                if isinstance(record, dict) and isinstance(record.get("key"), str):
                    yield record["key"]


def _record_refs(raw: bytes) -> list[ArtifactRef]:
    """The ArtifactRefs in a persisted Prefect result record (its result is our JSON)."""
    record = json.loads(raw)
    result = record.get("result")
    if isinstance(result, str):
        result = json.loads(result)
    return list(_refs_in(result))


def _refs_in(value: Any) -> Iterator[ArtifactRef]:
    """ArtifactRefs anywhere in JSON data: ``{"__lowerflow_artifact__": ...}`` (results),
    ``{"$ref": ...}`` (stored documents) and ``{"ref": {...}}``/``{"uri", "sha256", "size", "kind"}``."""
    if isinstance(value, dict):
        for tag in (_REF_TAG, "$ref"):
            if set(value) == {tag} and isinstance(value[tag], dict):
                try:
                    yield ArtifactRef.from_json(value[tag])
                except Exception:
                    pass
                return
        if {"uri", "sha256", "size", "kind"} <= set(value):
            try:
                yield ArtifactRef.from_json(value)
            except Exception:
                pass
        for v in value.values():
            yield from _refs_in(v)
    elif isinstance(value, list):
        for v in value:
            yield from _refs_in(v)


def _files(fs, root: str) -> list[str]:
    try:
        return sorted(p for p in fs.find(root) if not posixpath.basename(p).endswith(".tmp"))
    except FileNotFoundError:
        return []


def _modified(fs, path: str) -> datetime.datetime:
    stamp = fs.modified(path)
    return stamp if stamp.tzinfo is not None else stamp.replace(tzinfo=datetime.timezone.utc)
