"""The fleet command's progress lines: ``[k/n] model  ok|FAILED  (s)``, one per model as it ends."""

from __future__ import annotations

import logging
import time
from typing import Callable


class FleetProgress(logging.Handler):
    """Prints ``[k/n] model  ok|FAILED  (s)`` as each model's flow reports its targets.

    It listens to the log records ``"<name>/<target> ok …"`` or ``"<name>/<target> FAILED
    <error> …"`` that ``flows.lower_model`` writes when a model's targets are done, for
    the models and targets of the manifest only.  They come from Prefect's run loggers
    (``prefect.flow_runs`` / ``prefect.task_runs``), which propagate to ``prefect`` at
    INFO whatever the console shows.
    """

    LOGGER = "prefect"

    def __init__(self, targets: dict[str, set[str]], emit_line: Callable[[str], None]) -> None:
        super().__init__(logging.INFO)
        self.pending = {name: set(t) for name, t in targets.items()}
        self.failed: set[str] = set()
        self.total = len(targets)
        self.done = 0
        self.emit_line = emit_line
        self.started = time.monotonic()

    def emit(self, record: logging.LogRecord) -> None:
        """Called under the handler's own lock (``Handler.handle``), so one thread at a time."""
        try:
            message = record.getMessage()
        except Exception:
            return
        head, _, outcome = message.partition(" ")
        name, _, target = head.rpartition("/")
        if (outcome := outcome.split(" ", 1)[0]) not in ("ok", "FAILED"):  # "ok 0.84 s: 2 ran (…)…"
            return
        remaining = self.pending.get(name)
        targets = set(target.split(","))  # "cnn/portable,xnnpack FAILED ...": one cause for both
        if remaining is None or not targets & remaining:
            return
        remaining -= targets
        if outcome != "ok":
            self.failed.add(name)
        if not remaining:
            self.done += 1
            status = "FAILED" if name in self.failed else "ok"
            self.emit_line(f"[{self.done}/{self.total}] {name:<20} {status:<6} {time.monotonic() - self.started:7.1f} s")

    def listening(self):
        """Context manager attaching the handler to Prefect's run loggers' parent (level INFO)."""
        import contextlib

        @contextlib.contextmanager
        def attached():
            logger = logging.getLogger(self.LOGGER)
            old_level = logger.level
            if logger.getEffectiveLevel() > logging.INFO:
                logger.setLevel(logging.INFO)
            logger.addHandler(self)
            try:
                yield self
            finally:
                logger.removeHandler(self)
                logger.setLevel(old_level)

        return attached()
