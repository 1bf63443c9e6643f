"""The console and environment of lowerflow's commands (``lowerflow``, ``./run demo``).

Settings Prefect reads when it is imported (so set first), and a console that shows
lowerflow's own lines only unless ``--verbose``, and the lines of ``lowerflow verify``.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any


#: Seconds Prefect's ephemeral API server gets to start (Prefect's default is 20):
#: its first start creates and migrates the database, which took 25-40 s and more on a
#: 2-core machine at load 5-9; 180 s is ample for that and still ends a run whose
#: server cannot start within minutes.  (``flows/__init__.py`` sets the same.)
EPHEMERAL_STARTUP_TIMEOUT = "180"
#: The setting (environment variable) Prefect reads it from.
EPHEMERAL_STARTUP_SETTING = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
#: Loggers whose records the console shows unless ``--verbose``: lowerflow's own.
OWN_LOGGERS = ("lowerflow", "lowering", "tasks", "flows")
#: Set to 1 by a command run with ``--verbose``, for the processes it starts (``lowerflow
#: worker``'s warm parent and flow runs): they show the libraries' warnings too.
VERBOSE_ENV = "LOWERFLOW_VERBOSE"
#: Libraries whose loggers warn at import (torchao: ``Failed to load …_C_mxfp8…so``,
#: ``Detected no triton``): errors only, unless verbose.
LIBRARY_LOGGERS = ("torchao", "transformers")


def quiet_libraries() -> None:
    """A worker's process (its warm parent, a flow run) as quiet as the CLI: no Python
    warnings (torch's ``isinstance(treespec, LeafSpec)`` is deprecated: every warning is a
    library's), and only errors from torch's loggers and :data:`LIBRARY_LOGGERS`, unless
    :data:`VERBOSE_ENV` is set.  Call before torch is imported."""
    if os.environ.get(VERBOSE_ENV):
        return
    warnings.simplefilter("ignore")
    # torch's own loggers (``W… torch/utils/_pytree.py:630] … register_constant() …``, when
    # torchao registers its enums) at ERROR: read when torch is imported.
    os.environ.setdefault("TORCH_LOGS", "-all")
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def quiet_flow_run() -> None:
    """:func:`quiet_libraries` in a flow run a worker started (``PREFECT__FLOW_RUN_ID`` set;
    ``LOWERFLOW_VERBOSE=1`` shows them), called by the flows' modules before they import
    torch: Prefect loads an entrypoint ``flows/lower_model.py`` as a module of its own,
    not through this package."""
    if os.environ.get("PREFECT__FLOW_RUN_ID"):
        quiet_libraries()


def configure_environment(verbose: bool, store: str | None = None) -> None:
    """Settings read when Prefect and the stage tasks are imported, so set first.

    * no Prefect analytics (SQLite locks up under fan-out otherwise);
    * the ephemeral server's startup timeout (:data:`EPHEMERAL_STARTUP_TIMEOUT`);
    * Prefect's console handler at WARNING and its ephemeral server's logs at CRITICAL
      unless ``verbose`` (its API logs are kept),
      and no Python warnings (all of them are the libraries');
    * ``--store`` becomes ``$LOWERFLOW_STORE``, so result records and locks follow it.

    Values the user already set in the environment win.
    """
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    give_ephemeral_server_time()
    if verbose:
        os.environ[VERBOSE_ENV] = "1"  # a worker's warm parent and flow runs show everything too
    else:
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
        # The ephemeral API server is a subprocess writing to our stderr; at shutdown it
        # logs cancelled event flushes with tracebacks.  What matters reaches us as API errors.
        os.environ.setdefault("PREFECT_SERVER_LOGGING_LEVEL", "CRITICAL")
        # lowerflow reports through its own log records, never Python warnings: every
        # warning is a library's (torch's export notes, deprecations, the oracle's).
        warnings.simplefilter("ignore")
    if store:
        os.environ["LOWERFLOW_STORE"] = store


def ephemeral_startup_timeout() -> str:
    """The start-up timeout (s) Prefect's ephemeral server gets: Prefect's settings once
    Prefect is imported (it reads them at import), else the environment's, else Prefect's 20."""
    if "prefect.settings" in sys.modules:
        from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

        return str(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
    return os.environ.get(EPHEMERAL_STARTUP_SETTING, "20")


def give_ephemeral_server_time() -> None:
    """:data:`EPHEMERAL_STARTUP_TIMEOUT` for the ephemeral server, unless the user set
    :data:`EPHEMERAL_STARTUP_SETTING`.

    Prefect reads its settings once, when it is imported: a script that imported Prefect
    (or ``tasks``) before running the CLI kept Prefect's 20 s while the environment said
    180.  Then Prefect's settings are read again from the environment.
    """
    os.environ.setdefault(EPHEMERAL_STARTUP_SETTING, EPHEMERAL_STARTUP_TIMEOUT)
    if "prefect.context" in sys.modules and ephemeral_startup_timeout() != os.environ[EPHEMERAL_STARTUP_SETTING]:
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()


class _OwnRecords(logging.Filter):
    """Keeps the records of lowerflow's own loggers (:data:`OWN_LOGGERS`), drops the rest."""

    def filter(self, record: logging.LogRecord) -> bool:
        return any(record.name == n or record.name.startswith(n + ".") for n in OWN_LOGGERS)


class _Nothing(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


def quiet_console(verbose: bool) -> None:
    """Unless ``verbose``, the console shows lowerflow's own records only.

    * Prefect's console handler drops everyone else's records (Prefect's own, a
      failed model's traceback, torchao's and transformers' import warnings): a
      failed model is reported by our table.  The records still reach the Prefect
      API (the UI shows them).
    * torch's own handlers (torch logs on a handler of its own, e.g. the fake-tensor
      traceback of a model whose inputs have the wrong shape) show nothing.

    Call after importing Prefect (its import sets up the handlers).
    """
    if verbose:
        return
    from prefect.logging.handlers import PrefectConsoleHandler

    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler) and not any(isinstance(f, _OwnRecords) for f in handler.filters):
            handler.addFilter(_OwnRecords())
    torch_loggers = [n for n in list(logging.root.manager.loggerDict) if n == "torch" or n.startswith("torch.")]
    root_handlers = set(logging.getLogger().handlers)  # the process's own (e.g. pytest's capture): left alone
    for name in torch_loggers:  # torch gives many of its loggers a stderr handler of their own
        for handler in getattr(logging.getLogger(name), "handlers", []):
            if handler not in root_handlers and not any(isinstance(f, _Nothing) for f in handler.filters):
                handler.addFilter(_Nothing())


def say(line: str = "") -> None:
    """One line of our output on stdout (flushed: Prefect writes to stderr meanwhile)."""
    print(line, flush=True)


def first_line(text: str) -> str:
    """The first non-empty line of ``text``."""
    return next((l.strip() for l in str(text).splitlines() if l.strip()), "")


def verify_line(check: Any) -> str:
    """``"lowerflow   ok       max |diff| 2.4e-07"`` for one RuntimeCheck; a check at
    dynamic sizes says which (``"... 2.4e-07  (batch=32)"``)."""
    sizes = "" if getattr(check, "inputs", "example") == "example" else f"  ({check.inputs})"
    if check.ok is None:
        return f"{check.runtime:<11} skipped  {check.skipped or ''}".rstrip() + sizes
    diff = "" if check.max_abs_diff is None else f"max |diff| {check.max_abs_diff:.3g}"
    status = "ok" if check.ok else "MISMATCH"
    error = "" if check.ok or not check.error else f"  {first_line(check.error)}"
    return f"{check.runtime:<11} {status:<8} {diff}".rstrip() + sizes + error
