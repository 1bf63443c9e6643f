"""``lowerflow``: the command line of the lowering flows.

    lowerflow lower SPEC --target T [--target T2] [-o OUT] [--store URL]
    lowerflow fleet MANIFEST [--pool POOL]
    lowerflow worker --pool POOL [--work-queue Q] [--limit N]
    lowerflow plan MANIFEST
    lowerflow verify FILE.pte --model SPEC
    lowerflow gc STORE [--keep-days N] [--dry-run]
    lowerflow ui [--port P]

With no configuration the flows use Prefect's ephemeral server and the store
``$LOWERFLOW_STORE`` or ``./.lowerflow``.  Prefect's console logging is quieted to
warnings unless ``--verbose`` (its logs still go to the Prefect API).  A failure prints one line ``lowerflow: error: <reason>`` on
stderr (the traceback too with ``--debug``) and exits non-zero: 1 for a failed
lowering or verification, 2 for bad usage or a bad manifest.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Sequence

from .console import configure_environment, ephemeral_startup_timeout, quiet_console, say  # noqa: F401 - configure_environment: the CLI's API (demo)
from .console import first_line, verify_line
from .cli_args import (  # noqa: F401 - CLIError and the exit codes: the CLI's API
    EXIT_FAILED, EXIT_OK, EXIT_USAGE, CLIError, check_targets, parse_dynamic_shapes, parse_quantize, parse_targets,
    add_gate_arguments, gate_arguments, parse_runtime_ops, parse_spec,
)
from .fleet_progress import FleetProgress
from .load_options import add_load_arguments, load_arguments
from .verify_mode import CHECK_MODES
from tasks.heap import set_heap_policy

PROG = "lowerflow"
#: Default ``-o`` of ``lower``: one file per target in the current directory.
DEFAULT_OUTPUT = "{name}.{target}.pte"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is the one-line ``lowerflow: error: ...`` (exit 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise CLIError(f"{message} (see '{self.prog} --help')", EXIT_USAGE)


# --------------------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    """The ``lowerflow`` argument parser with its subcommands."""
    parser = _Parser(prog=PROG, description="Lower PyTorch models to ExecuTorch .pte files with cached Prefect flows.",
                     parents=[_common_options(False)])
    # Accepted after the subcommand too; SUPPRESS keeps a value given before it.
    common = _common_options(argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)

    lower = sub.add_parser("lower", parents=[common], help="lower one model for one or more targets",
                           description="Run the lower-model flow and write the .pte file(s).")
    lower.add_argument("spec", metavar="SPEC", help="model spec: path/file.py:factory, package.module:factory, "
                       "a .pt2 URL or hf:<dir or hub id>")
    lower.add_argument("--target", "-t", action="append", dest="targets", metavar="T",
                       help=f"target: {', '.join(_target_names())}; or a chain NAME=BACKEND,BACKEND,... "
                            "(e.g. android=vulkan,xnnpack: each backend takes what the ones before it left); "
                            "repeat for several (default: portable)")
    lower.add_argument("-o", "--output", default=DEFAULT_OUTPUT, metavar="OUT",
                       help="output .pte path; may use {name} and {target}; a directory for several targets "
                            f"(default: {DEFAULT_OUTPUT})")
    lower.add_argument("--store", metavar="URL", help="artifact store URL (default: $LOWERFLOW_STORE or ./.lowerflow)")
    lower.add_argument("--dynamic-shapes", metavar="JSON",
                       help="dynamic dims by forward argument, e.g. "
                            "'{\"x\": {\"0\": {\"name\": \"batch\", \"min\": 1, \"max\": 32}}}' "
                            "(replaces the factory's own)")
    lower.add_argument("--quantize", "-q", metavar="RECIPE",
                       help="quantize every target: int8 (static, needs calibration), int8-dynamic or 8da4w; "
                            "or JSON, e.g. '{\"recipe\": \"8da4w\", \"group_size\": 64}' or "
                            "'{\"xnnpack\": \"int8\"}' (per target)")
    lower.add_argument("--qembedding", metavar="BITS", choices=("8w", "4w"),
                       help="with --quantize 8da4w or int8-dynamic, quantize the embedding tables too: 8w (int8, "
                            "a scale per row) or 4w (int4, a scale per 32 values), as optimum-executorch's")
    lower.add_argument("--calibration", metavar="SPEC",
                       help="int8's calibration data: path/file.py:function, package.module:function or a "
                            "safetensors URL (default: the factory's own 'calibration')")
    lower.add_argument("--min-sqnr", type=float, metavar="DB",
                       help="fail a quantized target whose SQNR against fp32 eager is below DB")
    lower.add_argument("--max-error", type=float, metavar="E",
                       help="fail a quantized target whose max |Δ| / max |fp32| is above E")
    lower.add_argument("--runtime-ops", metavar="SETS", help="the op sets the .pte may call: some of portable, "
                       "quantized, llm, fused, comma-separated (default: all); emit fails an op outside them")
    lower.add_argument("--external-weights", action="store_true",
                       help="write the weights to <out>.ptd beside the .pte (which keeps the program only): "
                            "a retrain then ships a new .ptd and the same .pte (docs/external-weights.md)")
    add_verify_argument(lower)
    add_gate_arguments(lower, one_model=True)
    add_load_arguments(lower)
    lower.set_defaults(run=cmd_lower)

    fleet = sub.add_parser("fleet", parents=[common], help="lower every model of a fleet manifest",
                           description="Run the lower-fleet flow; exit 1 if any model failed.")
    fleet.add_argument("manifest", metavar="MANIFEST", help="fleet manifest (YAML or JSON)")
    fleet.add_argument("--pool", metavar="POOL",
                       help="lower each model as a flow run on this Prefect work pool's workers "
                            "(deployment lower-model/POOL, created from this checkout if missing; "
                            "needs PREFECT_API_URL); default: in this process")
    add_verify_argument(fleet, " (replaces every model's 'verify')")
    add_gate_arguments(fleet, one_model=False)
    fleet.set_defaults(run=cmd_fleet)

    worker = sub.add_parser("worker", parents=[common], help="run a work pool's flow runs, forked from a warm process",
                            description="A Prefect process worker whose flow runs start from a process that has "
                                        "imported torch, Prefect and lowerflow once (see flows/warm_start.py). "
                                        "Needs PREFECT_API_URL.")
    worker.add_argument("--pool", required=True, metavar="POOL", help="the work pool to poll")
    worker.add_argument("--work-queue", "-q", action="append", dest="work_queues", metavar="Q",
                        help="a work queue of the pool; repeat for several (default: models)")
    worker.add_argument("--limit", type=int, default=1, metavar="N",
                        help="flow runs at once (default: 1, a model lowers on one core; run one worker per core)")
    worker.add_argument("--name", metavar="NAME", help="the worker's name in Prefect (default: a generated one)")
    worker.add_argument("--threads", type=int, default=1, metavar="N",
                        help="torch threads per flow run (default: 1; OMP_NUM_THREADS wins if set)")
    worker.add_argument("--preload", action="append", default=[], metavar="MODULE",
                        help="a module the warm process imports once for every run (the fleet's model code, "
                             "e.g. transformers.models.bert.modeling_bert); repeat for several")
    worker.set_defaults(run=cmd_worker)

    plan = sub.add_parser("plan", parents=[common], help="show which stages of a fleet would run or hit the cache",
                          description="Dry run of a fleet manifest: nothing is lowered.")
    plan.add_argument("manifest", metavar="MANIFEST", help="fleet manifest (YAML or JSON)")
    plan.set_defaults(run=cmd_plan)

    verify = sub.add_parser("verify", parents=[common], help="run a .pte and compare it with the eager model",
                            description="Run FILE.pte in every available runtime against the model's eager outputs.")
    verify.add_argument("pte", metavar="FILE.pte", help="the program to run")
    verify.add_argument("--model", metavar="SPEC", help="model spec of the eager model and its inputs (without it, "
                                                      "only the .pte / --data pair is checked)")
    verify.add_argument("--data", metavar="FILE.ptd", help="the .ptd the program binds its weights from "
                                                          "(checked key by key before anything runs)")
    verify.add_argument("--dynamic-shapes", metavar="JSON", help="the --dynamic-shapes given to lower, if any")
    verify.add_argument("--verify", choices=CHECK_MODES, default="auto", metavar="MODE",
                        help="full (every input set, twice), quick (a decoder: one prefill and a few decode steps), "
                             "or auto (the default: full, quick for a model above 64 MiB of weights), as lower's")
    add_load_arguments(verify)  # an hf: model's --task, --max-seq-len, ... as given to lower
    verify.set_defaults(run=cmd_verify)

    gc = sub.add_parser("gc", parents=[common], help="remove store objects and cache records nothing uses",
                        description="Remove objects and cache records that no published output references and "
                                    "that are older than --keep-days (see tasks/gc.py for the rule).")
    gc.add_argument("store", metavar="STORE", help="artifact store URL (a directory, s3://bucket/prefix, ...)")
    gc.add_argument("--keep-days", type=float, default=7.0, metavar="N",
                    help="never remove anything younger than N days (default: 7; keep it above your longest run)")
    gc.add_argument("--dry-run", action="store_true", help="only report what would be removed")
    gc.set_defaults(run=cmd_gc)

    automations = sub.add_parser(
        "automations", parents=[common], help="install the Prefect automations of unattended nights",
        description="install: (re)create on the Prefect server of PREFECT_API_URL the automation that marks a "
                    "flow run Crashed when its heartbeats stop (a lost worker machine; lower-fleet then resubmits "
                    "the model), and, with --notify-url or --notify-block, one that notifies when a lower-fleet "
                    "run fails.  ls: show them.  See flows/automations.py.")
    automations.add_argument("action", choices=["install", "ls"], help="install (idempotent) or ls")
    automations.add_argument("--zombie-window", type=float, default=90.0, metavar="S",
                             help="seconds without a heartbeat before a run is Crashed (default: 90; runs send "
                                  "one every 30 s, PREFECT_FLOWS_HEARTBEAT_FREQUENCY in deployments/prefect.yaml)")
    automations.add_argument("--notify-url", metavar="URL",
                             help="POST {\"subject\", \"body\"} (JSON) here when a fleet fails "
                                  "(saved as the block custom-webhook/lowerflow-nightly)")
    automations.add_argument("--notify-block", metavar="TYPE/NAME",
                             help="or notify through a notification block you saved (e.g. slack-webhook/night-owl)")
    automations.add_argument("--fleet-window", type=float, default=30.0, metavar="S",
                             help="the same for lower-fleet runs (default: 30; the nightly deployment's send one "
                                  "every 10 s, LOWERFLOW_HEARTBEAT_SECONDS): a lost fleet is retried sooner")
    automations.set_defaults(run=cmd_automations)

    nights = sub.add_parser("nights", parents=[common], help="the last fleet runs: state, duration, cause, what to run",
                            description="The latest lower-fleet runs on the Prefect server of PREFECT_API_URL, "
                                        "newest first: when, state (and try), how long, the cause (the run's "
                                        "state message), and the whole `prefect flow-run retry` command of a "
                                        "failed one.  See flows/nights.py.")
    nights.add_argument("--limit", type=int, default=5, metavar="N", help="how many (default: 5)")
    nights.set_defaults(run=cmd_nights)

    ui = sub.add_parser("ui", parents=[common], help="serve the Prefect UI over the runs and reports made here",
                        description="Start a Prefect server on the database the CLI and the demo used "
                                    "(Prefect's ephemeral server's), with the UI's API URL set, and print "
                                    "the address of the fleet report. Serves until Ctrl-C.")
    ui.add_argument("--host", default="127.0.0.1", help="address to serve on (default: 127.0.0.1)")
    ui.add_argument("--port", type=int, default=4200, help="port (default: 4200)")
    ui.set_defaults(run=cmd_ui)
    return parser


def _common_options(default: Any) -> argparse.ArgumentParser:
    """``--verbose`` and ``--debug`` (a parent parser)."""
    common = _Parser(add_help=False)
    common.add_argument("--verbose", action="store_true", default=default, help="show Prefect's own log lines")
    common.add_argument("--debug", action="store_true", default=default, help="print a traceback on errors")
    return common


# --------------------------------------------------------------------------- lower


def add_verify_argument(parser: argparse.ArgumentParser, scope: str = "") -> None:
    """``--verify full|quick|off|auto`` (a bad value is a usage error, exit 2)."""
    from flows.verify_mode import MODES

    parser.add_argument("--verify", choices=MODES, metavar="MODE",
                        help="verify the .pte: full (every input set, twice), quick (a decoder: one prefill and "
                             "a few decode steps), off, or auto (the default: full, quick for a model above "
                             f"64 MiB of weights){scope}")


def _target_names() -> list[str]:
    """lowering.targets.target_names without importing torch (the parser is built on every call)."""
    from importlib import metadata

    return ["portable", *sorted({e.name for e in metadata.entry_points(group="lowerflow.backends")} - {"portable"})]


def cmd_lower(args: argparse.Namespace) -> int:
    """Run ``lower_model``; print its stages; write the .pte of every target that succeeded."""
    targets, target_options = parse_targets(args.targets or ["portable"])
    spec = parse_spec(args.spec, args)
    name = spec.name
    dynamic_shapes = parse_dynamic_shapes(args.dynamic_shapes, spec)
    check_targets(targets, target_options)
    quantize = {**parse_quantize(args, targets), **parse_runtime_ops(args.runtime_ops, targets),
                **gate_arguments(args, targets)}
    outputs = {t: output_path(args.output, name, t, several=len(targets) > 1) for t in targets}
    for path in outputs.values():
        check_writable(path)
    from flows.lower_model import ModelLoweringFailed, lower_cached, lower_model

    quiet_console(args.verbose)
    arguments = dict(model=args.spec, targets=targets, store=args.store, **quantize, **load_arguments(args, args.spec),
                     **({"options": target_options} if target_options else {}),
                     **({"verify": args.verify} if args.verify else {}),
                     **({"external_weights": True} if args.external_weights else {}),
                     **({"dynamic_shapes": dynamic_shapes} if dynamic_shapes is not None else {}))
    try:  # a cached rerun with no API server configured starts none (lower_cached)
        manifest = (lower_cached(**arguments) if not api_server_configured() else None) or lower_model(**arguments)
    except ModelLoweringFailed as exc:
        manifest = exc.manifest
    failed = []
    for target in targets:  # the manifest may also hold targets lowered earlier (keep_published)
        entry = manifest["targets"].get(target) or {}
        for line in stage_lines(target, entry.get("stages") or []):
            say(line)
        if entry.get("ok") and entry.get("pte"):
            path = outputs[target]
            size = write_pte(entry["pte"], manifest.get("store"), path)
            say(f"{target}: wrote {path} ({size:,} bytes)")
            if entry.get("ptd"):  # its weights: the .pte needs this file beside it
                data_path = path.with_suffix(".ptd")
                size = write_pte(entry["ptd"], manifest.get("store"), data_path, "ptd")
                say(f"{target}: wrote {data_path} ({size:,} bytes, the weights {path.name} needs)")
            if entry.get("accepted_regressions"):
                say(f"{target}: published although its gates refuse it (accepted): "
                    f"{'; '.join(entry['accepted_regressions'])}")
            if entry.get("quantize"):
                from flows.quantized import quantize_line

                say(f"{target}: {quantize_line(entry)}")
        else:
            failed.append(f"{target}: {entry.get('error') or 'failed'}")
    if manifest.get("store_error"):
        failed.append(manifest["store_error"])
    if manifest.get("error"):  # one outside cause for every target, and what to do (flows/outages.py)
        raise CLIError(f"{name}: {manifest['error']}")
    if failed:  # "<model>: <target>: <stage>: <error>; ..." or, for an outside cause, what to do
        raise CLIError(f"{name}: " + (hint_for("; ".join(failed)) or "; ".join(failed)))
    return EXIT_OK


def api_server_configured() -> bool:
    """Whether Prefect has an API server to talk to (``PREFECT_API_URL``); without one, a
    flow run starts Prefect's ephemeral server first."""
    from prefect.settings import get_current_settings

    return bool(get_current_settings().api.url)


def output_path(template: str, name: str, target: str, *, several: bool) -> Path:
    """Where ``lower`` writes a target's .pte.

    ``template`` may use ``{name}`` and ``{target}``.  An existing directory (or a
    path ending in ``/``) gets ``<name>.<target>.pte`` inside; with several targets
    a template without ``{target}`` is taken as a directory.
    """
    is_dir = template.endswith(("/", os.sep)) or Path(template).is_dir()
    if several and "{target}" not in template and not is_dir:
        if template.endswith(".pte"):
            raise CLIError(f"-o {template!r}: several targets need a directory or '{{target}}' in the name", EXIT_USAGE)
        is_dir = True
    if is_dir:
        return Path(template) / DEFAULT_OUTPUT.format(name=name, target=target)
    try:
        return Path(template.format(name=name, target=target))
    except (KeyError, IndexError, ValueError) as exc:
        raise CLIError(f"-o {template!r}: only {{name}} and {{target}} may be used ({exc})", EXIT_USAGE) from None


def stage_lines(target: str, stages: Sequence[dict]) -> list[str]:
    """``"portable  export            cached    0.01 s"`` per stage record."""
    lines = []
    for r in stages:
        state = r.get("state")
        status = "cached" if r.get("cached") else ("FAILED" if state == "Failed" else "ran")
        size = f"  {r['bytes']:>12,} B" if isinstance(r.get("bytes"), int) else ""
        stage = r.get("stage", "?") + (f"[{r['method']}]" if r.get("method") else "")
        lines.append(f"{target:<10} {stage:<19} {status:<7} {float(r.get('seconds') or 0.0):7.2f} s{size}")
    return lines


def check_writable(path: Path) -> None:
    """Fail before any lowering if ``path`` cannot be written (exit status 2): its
    directory must exist or be creatable, and accept a file."""
    directory = path.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".{path.name}.probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise CLIError(f"-o {str(path)!r}: cannot write there: {exc.strerror or exc}", EXIT_USAGE) from None


def write_pte(pte: dict, store_url: str | None, path: Path, kind: str = "pte") -> int:
    """Copy the target's .pte (or ``kind`` "ptd": its .ptd) out of the store (digest-checked)
    to ``path``; returns its size."""
    from tasks.store import ArtifactRef, ArtifactStore

    ref = ArtifactRef(str(pte["uri"]), str(pte["sha256"]), int(pte["size"]), kind)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return ArtifactStore(store_url).copy_out(ref, str(path))
    except OSError as exc:
        raise CLIError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None


# --------------------------------------------------------------------------- fleet


def cmd_fleet(args: argparse.Namespace) -> int:
    """Run the fleet (see :func:`run_fleet`); exit 1 if any model failed."""
    summary = run_fleet(args.manifest, verbose=args.verbose, pool=args.pool, verify=args.verify,
                        accept_regressions=args.accept_regressions)
    check_fleet(summary)
    return EXIT_OK


def check_fleet(summary: dict) -> None:
    """The one-line CLIError (exit 1) of a fleet summary, or a plan, with failed models."""
    if summary.get("failed"):
        reasons = "; ".join(f"{name} ({model_error(summary['models'].get(name) or {})})" for name in summary["failed"])
        raise CLIError(f"{len(summary['failed'])} of {len(summary['models'])} models failed: {reasons}")


def cmd_worker(args: argparse.Namespace) -> int:
    """Poll the pool until interrupted (see :mod:`flows.warm_start`)."""
    from flows.warm_worker import run_worker

    if not prefect_api_url():
        raise CLIError("a worker needs the Prefect server its flow runs are on: set PREFECT_API_URL "
                       "(e.g. http://127.0.0.1:4200/api; see deployments/README.md)", EXIT_USAGE)
    if args.limit < 1 or args.threads < 1:
        raise CLIError(f"--limit and --threads must be at least 1, not {args.limit} and {args.threads}", EXIT_USAGE)
    missing = [m for m in args.preload if not _module_exists(m)]
    if missing:
        raise CLIError(f"--preload: no module {', '.join(map(repr, missing))} in this Python "
                       f"({sys.executable})", EXIT_USAGE)
    queues = args.work_queues or ["models"]
    say(f"worker on pool {args.pool} (queues {', '.join(queues)}, {args.limit} run(s) at once) at "
        f"{prefect_api_url()}; Ctrl-C stops it")
    run_worker(args.pool, queues, args.limit, name=args.name, threads=args.threads, preload=args.preload)
    return EXIT_OK


def cmd_automations(args: argparse.Namespace) -> int:
    """``lowerflow automations install|ls`` (see :mod:`flows.automations`)."""
    from flows import automations

    if not prefect_api_url():
        raise CLIError("automations live on a Prefect server: set PREFECT_API_URL "
                       "(e.g. http://127.0.0.1:4200/api; see deployments/README.md)", EXIT_USAGE)
    if args.action == "ls":
        for line in automations.installed():
            print(line)
        return EXIT_OK
    try:
        created = automations.install(args.zombie_window, args.notify_url, args.notify_block, args.fleet_window)
    except automations.AutomationError as exc:
        raise CLIError(str(exc), EXIT_USAGE) from None
    for name, automation_id in created.items():
        print(f"installed automation '{name}' ({automation_id})")
    if automations.FAILED_FLEET_AUTOMATION not in created:
        say("no failure notification: give --notify-url URL or --notify-block TYPE/NAME to get one")
    return EXIT_OK


def cmd_nights(args: argparse.Namespace) -> int:
    """``lowerflow nights``: the last fleet runs (see :func:`flows.nights.night_lines`)."""
    import datetime

    from flows.nights import last_nights, night_lines

    if not prefect_api_url():
        raise CLIError("the nights are on a Prefect server: set PREFECT_API_URL "
                       "(e.g. http://127.0.0.1:4200/api; see deployments/README.md)", EXIT_USAGE)
    runs = last_nights(max(args.limit, 1))
    if not runs:
        say("no lower-fleet run yet")
    for line in night_lines(runs, datetime.datetime.now(datetime.timezone.utc)):
        print(line)
    return EXIT_OK


def _module_exists(name: str) -> bool:
    """Whether ``import name`` would find a module (its parent packages are imported to look)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def prefect_api_url() -> str | None:
    """The Prefect API the flows talk to (environment or profile); None: an ephemeral one."""
    from prefect.settings import get_current_settings

    return get_current_settings().api.url


def model_error(manifest: dict) -> str:
    """The first error of a model's manifest: ``"<target> <stage>: <Type>: <message>"``."""
    for target, entry in (manifest.get("targets") or {}).items():
        if entry.get("error"):
            return f"{target} {entry['error']}"
    return manifest.get("error") or "failed"


def run_fleet(manifest: str, *, verbose: bool = False, pool: str | None = None, verify: str | None = None,
              accept_regressions: bool = False) -> dict:
    """``lower_fleet`` with a progress line per model as it finishes, then the summary
    table; returns the fleet summary, failed models included (the demo uses this too).
    ``verify``: a mode every model's verify runs (``--verify``; None: each entry's own)."""
    fleet = load_fleet(manifest)
    from flows.lower_fleet import FleetFailed, PoolNotReady, ensure_model_deployment, lower_fleet
    from flows.reports import fleet_text_table

    quiet_console(verbose)
    if pool is not None:
        if not prefect_api_url():
            raise CLIError(f"--pool {pool} needs a Prefect server that the pool's workers reach: set "
                           "PREFECT_API_URL (e.g. http://127.0.0.1:4200/api; see deployments/README.md)", EXIT_USAGE)
        try:
            deployment = ensure_model_deployment(pool)
        except PoolNotReady as exc:
            raise CLIError(str(exc), EXIT_USAGE) from exc
        say(f"lowering {len(fleet.models)} models on work pool {pool} ({deployment}) into "
            f"{fleet.store or 'the default store'}")
    else:
        say(f"lowering {len(fleet.models)} models into {fleet.store or 'the default store'}")
    progress = FleetProgress({m.name: set(m.targets) for m in fleet.models}, say)
    with progress.listening():
        try:
            summary = lower_fleet(str(manifest), pool=pool, **({"verify": verify} if verify else {}),
                                  **({"accept_regressions": True} if accept_regressions else {}))
        except FleetFailed as exc:
            summary = exc.summary
    say()
    say(fleet_text_table(summary))
    return summary


def load_fleet(path: str):
    """The validated manifest; a :class:`ManifestError` becomes exit status 2."""
    from flows.manifest import ManifestError, load_manifest

    try:
        return load_manifest(path)
    except ManifestError as exc:
        raise CLIError(str(exc), EXIT_USAGE) from exc


# --------------------------------------------------------------------------- plan


def cmd_plan(args: argparse.Namespace) -> int:
    """Per model and target, the stages cached and to run (flows/plan_text.py).  Validated
    and loaded as ``fleet`` does, failing with ``fleet``'s exit status and line."""
    fleet = load_fleet(args.manifest)
    from flows.lower_fleet import plan_models
    from flows.plan_text import plan_lines

    quiet_console(args.verbose)
    plan = plan_models(fleet)
    say("\n".join(plan_lines(plan, verbose=args.verbose)))
    check_fleet(plan)
    return EXIT_OK


# --------------------------------------------------------------------------- verify


def cmd_verify(args: argparse.Namespace) -> int:
    """Run the .pte in each runtime against the eager model, as the flow's verify does (a
    dynamic model at each Dim's min and max too; every method of several, and that the
    .pte has exactly those); exit 1 on a mismatch."""
    from tasks.model_spec import ModelSpecError, load_model

    if args.model is None:
        if args.data is None:
            raise CLIError("verify: give --model SPEC (run against eager) or --data FILE.ptd (check the pair)",
                           EXIT_USAGE)
        check_program_data(args.pte, args.data)
        say(f"{args.pte}: every weight it needs is in {args.data}")
        return EXIT_OK
    spec = parse_spec(args.model, args)
    dynamic_shapes = parse_dynamic_shapes(args.dynamic_shapes, spec)
    options = {**load_arguments(args, args.model), **({} if dynamic_shapes is None else {"dynamic_shapes": dynamic_shapes})}
    if spec.kind == "pt2":
        raise CLIError(f"model spec {spec.text!r}: verify needs a factory's eager model, not a .pt2", EXIT_USAGE)
    try:
        loaded = load_model(spec, options or None)
    except ModelSpecError as exc:
        raise CLIError(str(exc), EXIT_USAGE) from exc
    data = check_program_data(args.pte, args.data)
    pte = Path(args.pte)  # read by path: ExecuTorch's runtime maps the file
    from lowering.verify import resolve_mode, verify, verify_methods, verify_quick
    from lowering.verify_executorch import with_data

    mode = resolve_mode(args.verify, loaded.weights_size())
    pte = with_data(pte, data)
    try:
        if loaded.methods:  # every method at once: one fresh interpreter for a program of llama:: ops
            reports = verify_methods(pte, {n: (m.module, m.inputs, m.dynamic_shapes) for n, m in loaded.methods.items()},
                                     constants=loaded.constants, mode=mode)
        elif mode == "quick":
            reports = {None: verify_quick(pte, loaded.module, loaded.inputs)}
        else:
            reports = {None: verify(pte, loaded.module, loaded.inputs, dynamic_shapes=loaded.dynamic_shapes)}
    except Exception as exc:  # not a .pte at all
        raise CLIError(f"cannot verify {args.pte!r}: {type(exc).__name__}: {first_line(str(exc))}") from exc
    bad = []
    for method, report in reports.items():
        for check in report.checks:
            say(verify_line(check) if method is None else f"{method:<11} {verify_line(check)}")
            if check.ok is False:
                bad.append(check.runtime if method is None else f"{check.runtime} ({method})")
    if bad:
        raise CLIError(f"{args.pte} does not match {args.model} in {', '.join(bad)}")
    return EXIT_OK


def check_program_data(pte: str, data: str | None) -> str | None:
    """``--data`` (the .ptd's path; None without it), after checking the pair key by key
    (:func:`lowering.external.check_pair`): a program that needs a .ptd it was not given, or a
    .ptd of another program, is one line and exit 2, before any runtime loads it.  Both files
    are memory-mapped: what is read is the program's table, its delegates' payloads and the
    .ptd's table, never the weights (the runtimes then read the files themselves)."""
    from lowering.external import ExternalDataError, check_pair, map_file

    try:
        program = map_file(pte)
        blob = map_file(data) if data is not None else None
    except OSError as exc:
        raise CLIError(f"cannot read {exc.filename or pte!r}: {exc.strerror or exc}", EXIT_USAGE) from None
    try:
        check_pair(program, blob, pte_name=pte, ptd_name=data or "data")
    except ExternalDataError as exc:
        raise CLIError(str(exc), EXIT_USAGE) from None
    except Exception as exc:  # not a .pte at all
        raise CLIError(f"cannot verify {pte!r}: {type(exc).__name__}: {first_line(str(exc))}") from None
    return data


# --------------------------------------------------------------------------- gc


def cmd_gc(args: argparse.Namespace) -> int:
    """Mark from the published outputs, sweep what is old and unused (tasks.gc)."""
    from tasks.gc import collect
    from tasks.store import ArtifactStore

    if args.keep_days < 0:
        raise CLIError(f"--keep-days must be >= 0, got {args.keep_days:g}", EXIT_USAGE)
    store = ArtifactStore(args.store)
    if store.is_local and not Path(store.root).is_dir():
        raise CLIError(f"store {args.store!r} does not exist", EXIT_USAGE)
    report = collect(store, keep_days=args.keep_days, dry_run=args.dry_run)
    say(report.summary())
    for missing in report.missing[:10]:
        say(f"warning: a published manifest needs {missing}, which is not in the store (the next run recomputes it)")
    return EXIT_OK


# --------------------------------------------------------------------------- main


#: Failures whose cause is outside lowerflow, and what to do about them.
HINTS = (
    ("ephemeral Prefect API server",
     "Prefect's temporary API server did not start in time (PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="
     "{timeout}); raise it, or run 'prefect server start' and set PREFECT_API_URL=http://127.0.0.1:4200/api"),
    ("database is locked",
     "Prefect's SQLite database is locked by another process; set PREFECT_SERVER_ANALYTICS_ENABLED=false, "
     "or run a Prefect server on PostgreSQL (see deployments/README.md)"),
    ("All connection attempts failed",
     "cannot reach the Prefect API at PREFECT_API_URL={api}; start it ('prefect server start') or unset "
     "PREFECT_API_URL to use a temporary server"),
)


def hint_for(text: str) -> str | None:
    """What to do about a failure whose cause is outside lowerflow (:data:`HINTS`, an
    unreachable store: :func:`flows.outages.store_down`), or None."""
    from flows.outages import store_down

    if (down := store_down(text, os.environ.get("LOWERFLOW_STORE"))) is not None:
        return down
    for needle, hint in HINTS:
        if needle in text:
            cause = next((part.strip() for part in text.split("; ") if needle in part), first_line(text))
            return hint.format(
                timeout=ephemeral_startup_timeout(),
                api=os.environ.get("PREFECT_API_URL", "(unset)"),
                store=f" {os.environ['LOWERFLOW_STORE']}" if os.environ.get("LOWERFLOW_STORE") else "",
                cause=first_line(cause),
            )
    return None


def error_message(exc: BaseException) -> str:
    """One line: a CLIError's message; for a known outside cause, what to do;
    else ``<ExceptionType>: <first line of its message>``."""
    line = first_line(str(exc))
    if isinstance(exc, CLIError):
        return line
    hint = hint_for(str(exc))
    if hint is not None:
        return hint
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


def print_error(prog: str, exc: BaseException, debug: bool) -> int:
    """``<prog>: error: <one line>`` on stderr (the traceback first with ``debug``); the exit status."""
    if debug:
        traceback.print_exc()
    more = "" if debug or isinstance(exc, CLIError) else " (--debug shows the traceback)"
    print(f"{prog}: error: {error_message(exc)}{more}", file=sys.stderr)
    return exc.code if isinstance(exc, CLIError) else EXIT_FAILED


def cmd_ui(args: argparse.Namespace) -> int:
    from flows.ui import UiError, serve

    try:
        return serve(args.host, args.port, verbose=args.verbose)
    except UiError as exc:
        raise CLIError(str(exc), EXIT_USAGE) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lowerflow`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        configure_environment(args.verbose, getattr(args, "store", None))
        set_heap_policy()  # freed weights go back to the system: the peak is what a stage holds
        return args.run(args)
    except KeyboardInterrupt:
        print(f"{PROG}: error: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        return print_error(PROG, exc, debug)


if __name__ == "__main__":
    sys.exit(main())
