"""The names of the stage task runs: ``emit[cnn/xnnpack]``, ``preprocess[cnn/xnnpack#2]``.

Prefect names a task run ``emit-3f2`` unless the task has a ``task_run_name``; a
stage's is :func:`task_run_name`, which reads the :class:`RunLabel` the DAG set
with :func:`labelled` where it knows the model, method, target and partition::

    with labelled(model="cnn"):                 export[cnn]
        with labelled(target="xnnpack"):        partition[cnn/xnnpack] … emit[cnn/xnnpack]
            with labelled(partition=2):         preprocess[cnn/xnnpack#2]

The label is a context variable: each model's thread (and each copy of a context)
has its own.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Iterator


@dataclasses.dataclass(frozen=True)
class RunLabel:
    """What a stage task run is of: the model, its method, the target, the partition.

    ``str()``: ``cnn/xnnpack``, ``cnn/xnnpack#2`` (partition 2), ``cnn`` (export),
    ``lm.decode/portable`` (method ``decode`` of a model of several methods).
    """

    model: str | None = None
    method: str | None = None
    target: str | None = None
    partition: int | None = None

    def __str__(self) -> str:
        text = (self.model or "") + (f".{self.method}" if self.method else "")
        if self.target:
            text += f"/{self.target}"
        if self.partition is not None:
            text += f"#{self.partition}"
        return text


_RUN_LABEL: contextvars.ContextVar[RunLabel] = contextvars.ContextVar("lowerflow_run_label", default=RunLabel())


@contextlib.contextmanager
def labelled(**parts: Any) -> Iterator[None]:
    """The stage task runs started inside are of ``parts`` (fields of :class:`RunLabel`,
    added to the enclosing label): the DAG says ``labelled(model="cnn")`` around export,
    ``labelled(target="xnnpack")`` around a target's stages, and so on."""
    token = _RUN_LABEL.set(dataclasses.replace(_RUN_LABEL.get(), **parts))
    try:
        yield
    finally:
        _RUN_LABEL.reset(token)


def current_label() -> RunLabel:
    return _RUN_LABEL.get()


def task_run_name(stage: str) -> Callable[[], str]:
    """The name of a stage's task runs (Prefect's ``task_run_name``): ``emit[cnn/xnnpack]``,
    ``preprocess[cnn/xnnpack#2]``, ``export[cnn]``; the bare stage outside any label.
    Prefect calls it in the thread (and context) that runs the task."""

    def name() -> str:
        label = str(_RUN_LABEL.get())
        return f"{stage}[{label}]" if label else stage

    name.__qualname__ = name.__name__ = f"{stage}_run_name"
    return name
