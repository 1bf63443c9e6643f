"""The demo: lower the demo fleet (``examples/fleet.yaml``) and show what came out.

    python -m examples.demo [--verbose] [--debug]   # what ``./run demo`` runs

Runs the ``lower-fleet`` flow on Prefect's ephemeral server (nothing to start),
prints a line per model as it finishes, the fleet table, and where the ``.pte``
files and reports are.  Run it twice: the second run takes every stage from the cache.
"""

from __future__ import annotations

import sys
from pathlib import Path

#: The demo fleet, found next to this file whatever the working directory.
FLEET = Path(__file__).resolve().parent / "fleet.yaml"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    verbose, debug = "--verbose" in args, "--debug" in args
    from flows.cli import configure_environment, print_error, run_fleet

    configure_environment(verbose)  # before Prefect is imported
    try:
        summary = run_fleet(str(FLEET), verbose=verbose)
    except KeyboardInterrupt:
        print("demo: error: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # one line, never a traceback (unless --debug)
        return print_error("demo", exc, debug)
    print(f"\nstore: {summary['store']}")
    for name, manifest in summary["models"].items():
        for target, entry in manifest["targets"].items():
            if entry.get("pte"):
                print(f"  {name}/{target}: {entry['pte']['uri']}")
    print("reports: Prefect artifacts 'lowerflow-fleet' and 'lowerflow-model-<name>'; "
          f"memory-plan pictures in {summary['store']}/outputs/<name>/")
    print("see them in the Prefect UI: .venv/bin/lowerflow ui   (then open the fleet report address it prints)")
    if summary.get("failed"):
        print(f"FAILED: {', '.join(summary['failed'])}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
