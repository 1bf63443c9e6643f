"""The lowering stages as Prefect tasks (:class:`StageTasks`), and the same stages looked up in
their cache without Prefect running anything (:class:`StageLookup`): what the flows call.
The stage bodies (``run_<stage>``), their versions and what their keys leave out are
:mod:`tasks.stages`'."""

from __future__ import annotations

import inspect
import time
from typing import Any, Callable

from . import stages
from .cache import CacheConfig, check_result, iter_refs, stage_task
from .run_names import task_run_name
from .stages import STAGE_IGNORES, STAGE_OPTIONAL, STAGE_VERSIONS, stage_inputs
from .torch_lock import TORCH_LOCK


class StageTasks:
    """The stage tasks bound to one cache configuration (store, result storage, locks).

    ``stages.export`` … ``stages.verify_sequence`` are made on first use: a run
    whose stages all hit the cache (looked up with :class:`StageLookup` first) makes
    none, where making all twelve was 15 ms of a cached model run (py-spy, issue 9).
    """

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.store = config.artifact_store()

    def __getattr__(self, stage: str):
        """The task of ``stage`` (only attributes not yet set get here), made once.  Its
        body is :mod:`tasks.stages`' ``run_<stage>`` as it is then (tests replace bodies)."""
        if stage not in STAGE_IGNORES:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {stage!r}")
        task = self._make(stage, getattr(stages, f"run_{stage}"), STAGE_IGNORES[stage], STAGE_OPTIONAL.get(stage, ()))
        setattr(self, stage, task)
        return task

    def _make(self, stage: str, body: Callable[..., dict], ignore: tuple[str, ...], optional: tuple[str, ...] = ()):
        store = self.store

        def run(*args: Any, **kwargs: Any) -> dict:
            # One at a time per process (tasks.torch_lock); torch's JSON serde too: two
            # threads deserializing at once fail with "_CURRENT_DESERIALIZER is already set".
            with TORCH_LOCK:
                return body(store, *args, **kwargs)

        # The task's parameters are the body's, less the store: what Prefect
        # shows, and what the cache key (and StageLookup) hash by name.
        signature = inspect.signature(body)
        run.__signature__ = signature.replace(parameters=list(signature.parameters.values())[1:])
        run.__name__ = f"{stage}_stage"
        run.__qualname__ = run.__name__
        return stage_task(stage, STAGE_VERSIONS[stage], config=self.config, ignore=ignore, optional=optional,
                          task_run_name=task_run_name(stage))(run)


class StageLookup:
    """Dry run: what each stage's cache holds, without running anything.

    ``lookup(stage, records, **inputs)`` returns the cached result of a stage (and
    records it as cached), or raises :class:`WouldRun` when the stage would run.
    Keys come from the same :class:`~tasks.cache.StageCachePolicy` the tasks use.
    :meth:`compute` runs one stage outside a flow (:data:`IN_PROCESS_STAGES`).
    """

    def __init__(self, config: CacheConfig) -> None:
        from prefect.filesystems import LocalFileSystem
        from prefect.results import ResultStore

        from .cache import result_serializer

        self.config = config
        self.store = config.artifact_store()
        storage = config.result_storage()
        if isinstance(storage, str):  # a saved block's slug (remote stores)
            from prefect.blocks.core import Block

            storage = Block.load(storage)
        else:
            storage = LocalFileSystem(basepath=str(storage))
        self.results = ResultStore(result_storage=storage, serializer=result_serializer())

    def __call__(self, stage: str, records: list[dict], **inputs: Any) -> Any:
        start = time.perf_counter()
        policy, key = self._policy_and_key(stage, inputs)
        result = None
        if self.results.exists(key):
            result = self.results.read(key).result
            try:
                policy.check_refs(result)
            except Exception:
                result = None
        records.append({
            "stage": stage,
            "cached": result is not None,
            "state": "Cached" if result is not None else "WouldRun",
            "seconds": round(time.perf_counter() - start, 4),
            "bytes": _result_bytes(result) if result is not None else None,
            "key": key,
        })
        if result is None:
            raise WouldRun(stage)
        return result


    def _policy_and_key(self, stage: str, inputs: dict[str, Any]):
        """The stage's cache policy (the task's) and its key for ``inputs``."""
        policy = self.config.policy(stage, STAGE_VERSIONS[stage], STAGE_IGNORES[stage], STAGE_OPTIONAL.get(stage, ()))
        return policy, policy.key_for(stage_inputs(stage, inputs))

    def compute(self, stage: str, records: list[dict], **inputs: Any) -> Any:
        """Run ``stage`` in this process, without a task run, and persist its result as its
        task would (the same key, record and serializer; under the stage's lock, so that a
        concurrent run computes it once): what :func:`flows.lower_model.lower_cached` does with
        the one stage of a retrain night (:data:`IN_PROCESS_STAGES`).  Appends its record."""
        import os
        import threading

        start = time.perf_counter()
        policy, key = self._policy_and_key(stage, inputs)
        holder = f"lowerflow-{os.getpid()}-{threading.get_ident()}"
        policy.lock_manager.acquire_lock(key, holder)
        try:
            if self.results.exists(key):  # computed meanwhile by another run
                result = self.results.read(key).result
                policy.check_refs(result)
                state = "Cached"
            else:
                with TORCH_LOCK:
                    result = getattr(stages, f"run_{stage}")(self.store, **inputs)
                check_result(stage, result)
                self.results.write(obj=result, key=key, holder=holder)
                state = "Completed"
        finally:
            policy.lock_manager.release_lock(key, holder)
        records.append({"stage": stage, "cached": state == "Cached", "state": state,
                        "seconds": round(time.perf_counter() - start, 4), "bytes": _result_bytes(result), "key": key})
        return result


#: The stages :meth:`StageLookup.compute` may run outside a flow: a retrain's weights bound to
#: last night's program (flows/weights_only.py), when nothing else of the night would run.
IN_PROCESS_STAGES = frozenset({"bind_weights", "bind_weights_methods"})


class WouldRun(Exception):
    """Raised by :class:`StageLookup` at the first stage that is not cached."""


def call_stage(task, records: list[dict], **kwargs: Any) -> Any:
    """Run one stage task; append its record (stage, cached?, seconds, state, cache key); return its result.

    A failed stage re-raises its error after recording it.
    """
    start = time.perf_counter()
    state = task(**kwargs, return_state=True)
    record = {
        "stage": task.name,
        "state": state.name,
        "cached": state.name == "Cached",
        "seconds": round(time.perf_counter() - start, 4),
        "bytes": None,
        # The cache record's key: what a published manifest keeps alive (tasks.gc).
        "key": task.cache_policy.key_for(stage_inputs(task.name, kwargs)),
    }
    records.append(record)
    result = state.result()  # raises the stage's exception if it failed
    record["bytes"] = _result_bytes(result)
    return result


def _result_bytes(result: Any) -> int | None:
    """Total size of the artifacts a stage result names (None if it names none)."""
    refs = list(iter_refs(result))
    return sum(r.size for r in refs) if refs else None


