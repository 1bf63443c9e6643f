"""Prefect caching for lowering stages: the cache policy, its configuration, JSON results.

A stage is a Prefect task made with :func:`stage_task`::

    @stage_task("partition", version="3")
    def partition(program: ArtifactRef, backend: str, options: dict) -> ArtifactRef:
        ...

Its cache key (:meth:`StageCachePolicy.key_for`) is the sha256 of canonical JSON of
the stage name and version, every task parameter (ArtifactRefs as their sha256), and
the versions of the code that computes it: see :mod:`tasks.cache_keys`.

Results are persisted with a JSON serializer that only knows ArtifactRefs and
plain JSON (no pickle).  On a cache hit, the ArtifactRefs of the cached result are
checked in the artifact store first; if one is missing or corrupt the stale
record is deleted with a warning and the stage recomputes.

Concurrent runs of the same stage on the same inputs compute once: the policy
uses SERIALIZABLE isolation with a lock manager, chosen by a *lock URL*
(``file`` by default, ``redis://...`` across machines): see :mod:`tasks.locks`.

Local layout next to the store (``<root>`` a local directory)::

    <root>/prefect/results/<stage>-<sha256>   Prefect result records (JSON)
    <root>/prefect/locks/<stage>-<sha256>.lock
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Mapping, Optional

from prefect import task
from prefect.cache_policies import CachePolicy
from prefect.locking.protocol import LockManager
from prefect.serializers import JSONSerializer

from .cache_keys import key_document, stage_key
from .locks import DEFAULT_LOCK_DIR, lock_manager_for, parse_lock_url, resolve_lock_url, warn
from .store import ArtifactCorrupt, ArtifactMissing, ArtifactRef, ArtifactStore

#: Marker of an ArtifactRef inside a persisted JSON result.
_REF_TAG = "__lowerflow_artifact__"

Verify = Literal["digest", "exists", "none"]


# --------------------------------------------------------------------------- policy


@dataclass
class StageCachePolicy(CachePolicy):
    """Cache key = stage, version, input digests, JSON parameters, torch/lowerflow versions.

    ``ignore`` names task parameters left out of the key (e.g. a live object passed
    alongside the ArtifactRef it was loaded from); ``optional`` names parameters left out
    while they are None (added to a stage after its keys were in use: a run that does not
    set one keeps the stage's old keys).  ``verify`` is how cached
    ArtifactRefs are checked before a hit is used: ``"digest"`` (read and hash,
    including every blob of program manifests), ``"exists"`` (objects present)
    or ``"none"``.  ``store_url``/``storage_options`` name the artifact store.
    """

    stage: str = ""
    version: str = "1"
    ignore: tuple[str, ...] = ()
    verify: Verify = "digest"
    store_url: Optional[str] = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    optional: tuple[str, ...] = ()

    def key_document(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """What the key hashes: stage, version, parameters (refs as digests), versions."""
        if not self.stage:
            raise ValueError("StageCachePolicy needs a stage name")
        params = {k: v for k, v in inputs.items()
                  if k not in self.ignore and not (v is None and k in self.optional)}
        return key_document(self.stage, self.version, params)

    def key_for(self, inputs: Mapping[str, Any]) -> str:
        """The cache key for these task parameters: ``<stage>-<sha256 hex>``."""
        return stage_key(self.stage, self.key_document(inputs))

    def compute_key(
        self,
        task_ctx: Any,
        inputs: dict[str, Any],
        flow_parameters: dict[str, Any],
        **kwargs: Any,
    ) -> Optional[str]:
        """Prefect hook: the key, after dropping a cached record whose artifacts are gone."""
        key = self.key_for(inputs)
        result_store = getattr(task_ctx, "result_store", None)
        if result_store is not None and self.verify != "none":
            self._drop_unusable_record(result_store, key)
        return key

    def store(self) -> ArtifactStore:
        """The artifact store the stage's ArtifactRefs live in."""
        return ArtifactStore(self.store_url, **self.storage_options)

    def check_refs(self, result: Any) -> None:
        """Raise ArtifactMissing/ArtifactCorrupt unless every ref in ``result`` is usable."""
        store = self.store()
        for ref in iter_refs(result):
            if self.verify == "digest":
                store.verify(ref, deep=True)
            elif not store.exists(ref):
                raise ArtifactMissing(f"{ref.kind} artifact {ref.sha256} is missing from store {store.url}")

    def _drop_unusable_record(self, result_store: Any, key: str) -> None:
        if not result_store.exists(key):
            return
        try:
            record = result_store.read(key)
        except Exception as exc:  # unreadable record: it would never be replaced otherwise
            problem = f"unreadable record: {type(exc).__name__}: {exc}"
        else:
            try:
                self.check_refs(record.result)
                return
            except (ArtifactMissing, ArtifactCorrupt) as exc:
                problem = str(exc)
        warn(f"stage {self.stage!r}: cached result {key} is unusable ({problem}); recomputing")
        delete_record(result_store, key)


def iter_refs(value: Any) -> Iterator[ArtifactRef]:
    """Every ArtifactRef in a task result (nested in lists, tuples and dicts)."""
    if isinstance(value, ArtifactRef):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from iter_refs(v)
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from iter_refs(v)


def delete_record(result_store: Any, key: str) -> None:
    """Remove the persisted result record ``key`` (and its in-memory copy) from a ResultStore."""
    storage = result_store.result_storage
    path = storage._resolve_path(key)
    result_store.cache.pop(str(path), None)
    fs = getattr(storage, "filesystem", None)
    if fs is not None:  # RemoteFileSystem block: any fsspec URL
        fs.rm(str(path))
    else:  # LocalFileSystem block
        Path(path).unlink(missing_ok=True)


# --------------------------------------------------------------------------- JSON results


def encode_json_object(obj: Any) -> Any:
    """``json.dumps(default=...)`` hook of the result serializer: ArtifactRefs only."""
    if isinstance(obj, ArtifactRef):
        return {_REF_TAG: obj.to_json()}
    raise TypeError(
        f"a stage result contains a {type(obj).__qualname__}; stages return ArtifactRefs "
        "and JSON data (store bytes in the ArtifactStore, not in the result)"
    )


def decode_json_object(obj: dict[str, Any]) -> Any:
    """``json.loads(object_hook=...)`` hook: rebuilds ArtifactRefs, imports nothing."""
    if len(obj) == 1 and _REF_TAG in obj:
        return ArtifactRef.from_json(obj[_REF_TAG])
    return obj


def result_serializer() -> JSONSerializer:
    """Prefect serializer for stage results: JSON with ArtifactRefs, never pickle."""
    return JSONSerializer(
        object_encoder=f"{__name__}.encode_json_object",
        object_decoder=f"{__name__}.decode_json_object",
        dumps_kwargs={"sort_keys": True},
    )


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class CacheConfig:
    """Where a stage's artifacts, result records and locks live.

    * ``store_url`` / ``storage_options``: the artifact store (default ``$LOWERFLOW_STORE``
      or ``./.lowerflow``).
    * ``results``: Prefect result storage.  Default for a local store:
      ``<root>/prefect/results``.  A remote store needs a saved block slug (see
      :func:`save_results_block`), as Prefect only accepts local paths or saved blocks.
    * ``lock_manager``: a lock manager object, used as it is; else the one of the lock
      URL ``lock_url`` (else ``$LOWERFLOW_LOCKS``, else ``file``: see
      :func:`lock_manager_for`).  ``lock_dir`` is where a bare ``file`` keeps its locks
      (default ``<root>/prefect/locks`` for a local store, ``~/.cache/lowerflow/locks``).
    * ``verify``: how cached refs are checked before a hit is used (see StageCachePolicy).
    """

    store_url: Optional[str] = None
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    results: Optional[str | Path] = None
    lock_manager: Optional[LockManager] = None
    lock_dir: Optional[Path] = None
    verify: Verify = "digest"
    lock_url: Optional[str] = None

    def artifact_store(self) -> ArtifactStore:
        return ArtifactStore(self.store_url, **dict(self.storage_options))

    @classmethod
    def for_store(cls, store_url: str | None, locks: str | None = None, **storage_options: Any) -> "CacheConfig":
        """The configuration flows use for a store URL: results beside a local store;
        for a remote one (``s3://``, ``memory://``, ...) a results block saved at
        ``<store>/prefect/results`` (needs the Prefect API).  Credentials and
        endpoints come from ``storage_options``, fsspec's configuration, or the
        environment the filesystem reads (for S3: ``AWS_ACCESS_KEY_ID``,
        ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL_S3``).  ``locks``: the lock URL
        (None: ``$LOWERFLOW_LOCKS``, else ``file``), checked here, before any work
        (:class:`LockConfigError`)."""
        parse_lock_url(*resolve_lock_url(locks))
        config = cls(store_url=store_url, storage_options=storage_options, lock_url=locks)
        store = config.artifact_store()
        if store.is_local:
            return config
        digest = hashlib.sha256(store.url.encode()).hexdigest()[:16]
        if store.url.startswith("memory:"):
            # Lives only in this process, and Prefect's RemoteFileSystem refuses
            # memory:/// paths: records go to a local directory of this URL's
            # (records that outlive the store fail their ref check: recompute).
            return dataclasses.replace(config, results=Path(records_location(store)[1]))
        return dataclasses.replace(config, results=save_results_block(config, name=f"lowerflow-results-{digest}"))

    def result_storage(self) -> str | Path:
        """What ``@task(result_storage=...)`` gets: a local Path or a saved block slug."""
        if self.results is not None:
            return self.results
        store = self.artifact_store()
        if not store.is_local:
            raise ValueError(
                f"store {store.url} is not local: give CacheConfig(results=<block slug>) "
                "(see tasks.cache.save_results_block)"
            )
        return Path(store.root) / "prefect" / "results"

    def locks(self) -> LockManager:
        """The lock manager that serializes identical concurrent stage runs (one per
        process and lock URL: see :func:`lock_manager_for`)."""
        if self.lock_manager is not None:
            return self.lock_manager
        return lock_manager_for(self.lock_url, default_dir=lambda: self.default_lock_dir())

    def default_lock_dir(self) -> Path:
        """Where a bare ``file`` lock URL keeps its locks: ``lock_dir``, else
        ``<root>/prefect/locks`` for a local store, else ``~/.cache/lowerflow/locks``."""
        if self.lock_dir is not None:
            return Path(self.lock_dir)
        store = self.artifact_store()
        return Path(store.root) / "prefect" / "locks" if store.is_local else DEFAULT_LOCK_DIR.expanduser()

    def policy(self, stage: str, version: str, ignore: tuple[str, ...] = (),
               optional: tuple[str, ...] = ()) -> StageCachePolicy:
        """The SERIALIZABLE cache policy of one stage."""
        return StageCachePolicy(
            stage=stage,
            version=str(version),
            ignore=tuple(ignore),
            optional=tuple(optional),
            verify=self.verify,
            store_url=self.artifact_store().url,
            storage_options=dict(self.storage_options),
            isolation_level="SERIALIZABLE",
            lock_manager=self.locks(),
        )


def records_location(store: ArtifactStore) -> tuple[Any, str]:
    """(filesystem, directory) of the Prefect result records of ``store``'s stages:
    ``<store>/prefect/results``, or for a ``memory://`` store a local directory of its
    URL's (see :meth:`CacheConfig.for_store`)."""
    if store.url.startswith("memory:"):
        import tempfile

        import fsspec

        digest = hashlib.sha256(store.url.encode()).hexdigest()[:16]
        return fsspec.filesystem("file"), f"{tempfile.gettempdir()}/lowerflow-results/{digest}"
    return store.fs, f"{store.root}/prefect/results"


def save_results_block(config: CacheConfig, name: str = "lowerflow-results") -> str:
    """Save a RemoteFileSystem block at ``<store>/prefect/results``; returns its slug.

    Needs the Prefect API.  Use the slug as ``CacheConfig(results=...)`` for remote stores.
    """
    from prefect.filesystems import RemoteFileSystem

    store = config.artifact_store()
    block = RemoteFileSystem(basepath=f"{store.url}/prefect/results", settings=dict(config.storage_options))
    block.save(name, overwrite=True)
    return f"remote-file-system/{name}"


def stage_task(
    stage: str,
    version: str = "1",
    *,
    config: CacheConfig | None = None,
    ignore: tuple[str, ...] = (),
    optional: tuple[str, ...] = (),
    **task_kwargs: Any,
) -> Callable[[Callable[..., Any]], Any]:
    """Decorator making a (synchronous) function a cached lowering stage (a Prefect task).

    The function must return ArtifactRefs and JSON data: anything else raises
    TypeError naming the stage (Prefect would only warn and never cache it).
    ``task_kwargs`` go to ``prefect.task`` (e.g. ``retries``).
    """
    config = config or CacheConfig()
    options = dict(
        name=stage,
        cache_policy=config.policy(stage, version, ignore, optional),
        result_storage=config.result_storage(),
        result_serializer=result_serializer(),
        persist_result=True,
    )
    options.update(task_kwargs)

    def decorate(fn: Callable[..., Any]) -> Any:
        @functools.wraps(fn)
        def run_stage(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            check_result(stage, result)
            return result

        return task(**options)(run_stage)

    return decorate


def check_result(stage: str, result: Any) -> None:
    """Raise TypeError unless ``result`` persists as JSON (ArtifactRefs and JSON data)."""
    try:
        json.dumps(result, default=encode_json_object, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"stage {stage!r} returned a result that cannot be cached: {exc}") from exc
