"""What lowerflow's runs log (the console and the Prefect UI's log tab): a line per
model and target, not a line per stage task run.

Prefect's task engine logs ``Finished in state Completed()`` (``Cached(type=COMPLETED)``
for a cache hit) at INFO for every task run: 115 lines for the demo fleet, none of
them saying which model or target.  :func:`install` demotes those records of
lowerflow's stage tasks to DEBUG (shown when ``PREFECT_LOGGING_LEVEL=DEBUG``);
a failed stage's record (ERROR) and every other task's pass untouched::

    before (INFO, per task run)                 after (INFO, per model and target)
    Finished in state Completed()               cnn/xnnpack ok 0.84 s: 2 ran (emit 0.10 s,
    Finished in state Cached(type=COMPLETED)        verify 0.52 s), 7 cached (export, partition, …)
    … ×115

:func:`target_line` is that line; ``flows.lower_model`` logs it when a model's
targets are done (the CLI's fleet progress listens for it, ``flows/cli.py``).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping

from tasks.stages import STAGE_VERSIONS

#: The logger Prefect's task engine writes each task run's records to.
TASK_RUN_LOGGER = "prefect.task_runs"
#: The start of the record demoted for a stage task that did not fail.
FINISHED = "Finished in state "


class StageFinishedToDebug(logging.Filter):
    """Demotes ``Finished in state …`` INFO records of lowerflow's stage tasks to DEBUG
    (dropped unless the logger is enabled for DEBUG).  On a logger, so it applies
    before any handler: the console's and the API's (the UI's log tab)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or getattr(record, "task_name", None) not in STAGE_VERSIONS:
            return True
        if not isinstance(record.msg, str) or not record.msg.startswith(FINISHED):
            return True
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


#: The logger Prefect's flow engine writes each flow run's records to.
FLOW_RUN_LOGGER = "prefect.flow_runs"


#: Prefect's records that repeat, for a failure lowerflow explains, what lowerflow's own
#: line says (the flow engine's, the engine's, a failed run's result write).
REPEATS = ("Encountered exception during execution", "Engine execution exited with unexpected exception")
#: What Prefect logs when a failed run's exception could not be stored as its result
#: (the store or Redis down): the failure itself is lowerflow's line.
FAILED_RESULT_WRITE = "Failed to write result"
#: lowerflow's flows (their failures are explained by their own lines).
OWN_FLOWS = ("lower-model", "lower-fleet")


class ExplainedTracebackToDebug(logging.Filter):
    """An ERROR record of a failure lowerflow already explains in one line keeps its line
    and loses its traceback, which goes to a DEBUG copy of the record instead::

        before  ERROR  Encountered exception during execution: FleetFailed('1 of 2 models failed: cnn')
                       Traceback (most recent call last): … 40 lines …
        after   ERROR  Encountered exception during execution: FleetFailed('1 of 2 models failed: cnn')
                DEBUG  (the same, with the traceback)

    Explained: an exception whose class says ``explained = True`` (a model's or the
    fleet's failure: their message is the summary), or an outage outside lowerflow
    (the store or Redis unreachable, :func:`flows.outages.outage`).  A stage task's
    ERROR records of an outage go to DEBUG whole: the model says it once, in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        logger = logging.getLogger(record.name)
        if _failed_result_write(record):
            return _to_debug(record, logger)
        if record.levelno < logging.ERROR:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and getattr(exc, "logged", False) and _message(record).startswith(REPEATS):
            return _to_debug(record, logger)  # lowerflow's line said it: Prefect's repeat, traceback and all
        if exc is not None and getattr(exc, "explained", False) and _message(record).startswith(REPEATS[1]):
            return _to_debug(record, logger)  # the flow engine's line said it already
        if record.name == TASK_RUN_LOGGER and _outage(str(exc) if exc is not None else _message(record)):
            record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
            return logger.isEnabledFor(logging.DEBUG)
        if exc is None or not (getattr(exc, "explained", False) or _outage(str(exc))):
            return True
        if logger.isEnabledFor(logging.DEBUG):
            copy = logging.makeLogRecord(record.__dict__)
            copy.levelno, copy.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
            logger.handle(copy)
        record.exc_info, record.exc_text = None, None
        return True


def _to_debug(record: logging.LogRecord, logger: logging.Logger) -> bool:
    """The record at DEBUG (dropped unless its logger is enabled for DEBUG)."""
    record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
    return logger.isEnabledFor(logging.DEBUG)


def _failed_result_write(record: logging.LogRecord) -> bool:
    """Prefect's "Failed to write result" for a failed run of lowerflow's (a stage task,
    or a model's or fleet's flow run): the exception's record was not stored, which
    nothing of lowerflow reads (a failed stage is never a cache hit)."""
    if not isinstance(record.msg, str) or not record.msg.startswith(FAILED_RESULT_WRITE):
        return False
    return getattr(record, "task_name", None) in STAGE_VERSIONS or getattr(record, "flow_name", None) in OWN_FLOWS


class HandledFailureOffConsole(logging.Filter):
    """On a worker's console (Prefect's console handler), a failed model is lowerflow's one
    line: Prefect's records of the same failure stay in the API (the UI's log tab) only::

        before  ERROR Task run failed with exception: RuntimeError('sensor offline') … Traceback …
                ERROR Finished in state Failed('Task run encountered an exception RuntimeError: …')
                ERROR sensor/portable,reference FAILED verify: RuntimeError: sensor offline
                INFO  Finished in state Failed('Flow run encountered an exception: ModelLoweringFailed: …')
        after   ERROR sensor/portable,reference FAILED verify: RuntimeError: sensor offline

    Off the console: a stage task's records at WARNING and above (the model's line names
    the stage and the error), and the ``Finished in state Failed`` line of a run of
    lowerflow's flows (the run's state; its own lines said why)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == TASK_RUN_LOGGER and record.levelno >= logging.WARNING \
                and getattr(record, "task_name", None) in STAGE_VERSIONS:
            return False
        if record.name == FLOW_RUN_LOGGER and getattr(record, "flow_name", None) in OWN_FLOWS \
                and isinstance(record.msg, str) and record.msg.startswith(FINISHED + "Failed"):
            return False
        return True


def _outage(text: str) -> bool:
    from flows.outages import outage

    return outage(text) is not None


def _message(record: logging.LogRecord) -> str:
    try:
        return record.getMessage()
    except Exception:
        return str(record.msg)


def install() -> None:
    """Put the filters on Prefect's run loggers and its console handlers (once; Prefect's
    logging setup keeps them)."""
    from prefect.logging.handlers import PrefectConsoleHandler

    for name, filters in ((TASK_RUN_LOGGER, (StageFinishedToDebug, ExplainedTracebackToDebug)),
                          (FLOW_RUN_LOGGER, (ExplainedTracebackToDebug,))):
        logger = logging.getLogger(name)
        for kind in filters:
            if not any(isinstance(f, kind) for f in logger.filters):
                logger.addFilter(kind())
    handlers = [h for name in ("", "prefect", TASK_RUN_LOGGER, FLOW_RUN_LOGGER) for h in logging.getLogger(name).handlers]
    for handler in handlers:
        if isinstance(handler, PrefectConsoleHandler) and not any(
                isinstance(f, HandledFailureOffConsole) for f in handler.filters):
            handler.addFilter(HandledFailureOffConsole())


def target_line(name: str, target: str, result: Mapping[str, Any]) -> str:
    """One target's outcome, stages and time on one line::

        cnn/xnnpack ok 0.84 s: 2 ran (emit 0.10 s, verify 0.52 s), 7 cached (export, partition, …)
        cnn/portable FAILED emit: ValueError: … | 0.21 s: 1 ran (emit 0.20 s), 2 cached (export, memory_plan)

    Starts ``"<name>/<target> ok"`` or ``"<name>/<target> FAILED"`` (what the CLI's
    fleet progress reads).  Stages repeated in a row (a preprocess per partition)
    are counted: ``preprocess×3``.
    """
    records = list(result.get("stages") or [])
    seconds = sum(float(r.get("seconds") or 0.0) for r in records)
    ran = [r for r in records if not r.get("cached")]
    cached = [r for r in records if r.get("cached")]
    parts = []
    if ran:
        parts.append(f"{len(ran)} ran ({', '.join(_ran(ran))})")
    if cached:
        parts.append(f"{len(cached)} cached ({', '.join(_grouped(cached))})")
    stages = ", ".join(parts) or "no stages"
    if result.get("ok"):
        return f"{name}/{target} ok {seconds:.2f} s: {stages}"
    return f"{name}/{target} FAILED {result.get('error')} | {seconds:.2f} s: {stages}"


def failure_lines(name: str, manifest: Mapping[str, Any]) -> list[str]:
    """A failed model's lines, one per cause: ``"<name>/<targets> FAILED <error>"``, the
    targets that failed alike (or all, for the model's own ``error``) joined by commas."""
    if manifest.get("error"):
        return [f"{name}/{','.join(manifest.get('targets') or {})} FAILED {manifest['error']}"]
    causes: dict[str, list[str]] = {}
    for target, result in (manifest.get("targets") or {}).items():
        if not result.get("ok"):
            causes.setdefault(str(result.get("error")), []).append(target)
    return [f"{name}/{','.join(targets)} FAILED {error}" for error, targets in causes.items()]


def _label(record: Mapping[str, Any]) -> str:
    return str(record.get("stage")) + (f"[{record['method']}]" if record.get("method") else "")


def _grouped(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """Stage labels, a run of the same one as ``label×n``."""
    out: list[tuple[str, int]] = []
    for record in records:
        label = _label(record)
        if out and out[-1][0] == label:
            out[-1] = (label, out[-1][1] + 1)
        else:
            out.append((label, 1))
    return [label if n == 1 else f"{label}×{n}" for label, n in out]


def _ran(records: list[Mapping[str, Any]]) -> list[str]:
    """Stages that ran with their seconds (a repeated one: its total), and how they ended
    when not Completed (``emit Failed 0.20 s``)."""
    out: list[list] = []
    for record in records:
        label, state = _label(record), str(record.get("state") or "")
        seconds = float(record.get("seconds") or 0.0)
        if out and out[-1][0] == label and out[-1][1] == state:
            out[-1][2] += seconds
            out[-1][3] += 1
        else:
            out.append([label, state, seconds, 1])
    return [f"{label}{'×' + str(n) if n > 1 else ''}{'' if state in ('Completed', '') else ' ' + state} {s:.2f} s"
            for label, state, s, n in out]
