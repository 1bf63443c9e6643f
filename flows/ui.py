"""``lowerflow ui``: the Prefect UI over the runs the CLI and the demo made, one command away.

The CLI and ``./run demo`` run on Prefect's ephemeral server, whose database is
``$PREFECT_HOME/prefect.db``: the runs and the report artifacts stay there after
the process ends, but no server serves them.  ``lowerflow ui`` starts
``prefect server start`` on that same database (the default connection URL, or
whatever ``PREFECT_API_DATABASE_CONNECTION_URL`` says), with the UI's API URL set
to the address it serves (a UI started on another port without it is blank:
"Can't connect to Server API"), waits until it answers, and prints where the
reports are::

    Prefect UI:   http://127.0.0.1:4200/
    fleet report: http://127.0.0.1:4200/artifacts/key/lowerflow-fleet
    last fleet:   http://127.0.0.1:4200/runs/flow-run/<id>

then the latest fleet report itself (its markdown; ``--verbose``: every model's latest
report's address too).  It serves until interrupted (Ctrl-C), then stops the server.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Callable

#: The artifact key of the fleet report (flows/lower_fleet.py publishes it).
FLEET_REPORT_KEY = "lowerflow-fleet"
#: The key prefix of the model reports (flows/reports.py: ``lowerflow-model-<name>``).
MODEL_REPORT_PREFIX = "lowerflow-model-"
#: The fleet flow's name (flows/lower_fleet.py).
FLEET_FLOW = "lower-fleet"
#: Seconds to wait for the server to answer (its first start migrates the database).
STARTUP_TIMEOUT = 120.0


class UiError(RuntimeError):
    """The UI server could not be started (the port is taken, or it did not come up)."""


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: lingering closed connections are no owner
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def server_environment(host: str, port: int) -> dict[str, str]:
    """This environment, with the UI pointed at the API it is served beside."""
    env = dict(os.environ)
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    env["PREFECT_UI_API_URL"] = f"http://{host}:{port}/api"
    env.pop("PREFECT_API_URL", None)  # the server serves the database; it is no client of another API
    return env


def start_server(host: str, port: int) -> subprocess.Popen:
    """``prefect server start`` in a session of its own (stopped as a group)."""
    if not port_is_free(host, port):
        raise UiError(f"port {port} on {host} is taken (another Prefect server?): choose one with --port")
    return subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(port)],
        env=server_environment(host, port), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        start_new_session=True,
    )


def wait_until_up(url: str, server: subprocess.Popen, timeout: float = STARTUP_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            err = (server.stderr.read() or b"").decode(errors="replace").strip().splitlines()
            raise UiError(f"prefect server exited ({server.returncode}): {err[-1] if err else 'no output'}")
        try:
            with urllib.request.urlopen(f"{url}/api/health", timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise UiError(f"prefect server did not answer at {url} within {timeout:.0f} s")


def _post(url: str, body: dict) -> list:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as r:
        return json.loads(r.read())


def latest_fleet_report(url: str) -> str | None:
    """The markdown of the newest fleet report (None: there is none)."""
    artifacts = _post(f"{url}/api/artifacts/latest/filter",
                      {"artifacts": {"key": {"any_": [FLEET_REPORT_KEY]}}, "limit": 1})
    return str(artifacts[0].get("data") or "") if artifacts else None


def model_report_links(url: str) -> dict[str, str]:
    """``model report <name>`` -> the address of each model's newest report, by name."""
    artifacts = _post(f"{url}/api/artifacts/latest/filter",
                      {"artifacts": {"key": {"like_": f"{MODEL_REPORT_PREFIX}%"}}, "limit": 200})
    return {f"model report {a['key'][len(MODEL_REPORT_PREFIX):]}": f"{url}/artifacts/artifact/{a['id']}"
            for a in sorted(artifacts, key=lambda a: a["key"])}


def report_links(url: str) -> dict[str, str]:
    """The UI's addresses: its root, the fleet report, the newest fleet run (when there is one)."""
    links = {"Prefect UI": f"{url}/"}
    artifacts = _post(f"{url}/api/artifacts/latest/filter",
                      {"artifacts": {"key": {"any_": [FLEET_REPORT_KEY]}}, "limit": 1})
    if artifacts:
        links["fleet report"] = f"{url}/artifacts/key/{FLEET_REPORT_KEY}"
    runs = _post(f"{url}/api/flow_runs/filter",
                 {"flows": {"name": {"any_": [FLEET_FLOW]}}, "sort": "EXPECTED_START_TIME_DESC", "limit": 1})
    if runs:
        links["last fleet"] = f"{url}/runs/flow-run/{runs[0]['id']}"
    return links


def stop_server(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(15)


def serve(host: str = "127.0.0.1", port: int = 4200, say: Callable[[str], None] = print, verbose: bool = False) -> int:
    """Start the UI server, print where the reports are and the latest fleet report itself
    (``verbose``: the address of every model's latest report too), serve until interrupted."""
    url = f"http://{host}:{port}"
    # Ctrl-C stops it whatever this process inherited: a parent that ignores SIGINT (some test
    # runners' workers) passes SIG_IGN down, and Python then installs no KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    server = start_server(host, port)
    try:
        wait_until_up(url, server)
        links = report_links(url)
        if verbose:
            links.update(model_report_links(url))
        width = max(map(len, links)) + 1
        for label, link in links.items():
            say(f"{label + ':':<{width}} {link}")
        if "fleet report" not in links:
            say("no fleet report yet: run `./run demo` or `lowerflow fleet MANIFEST` first")
        else:
            say("")
            say((latest_fleet_report(url) or "").rstrip())
            say("")
        say("serving; Ctrl-C stops the server")
        sys.stdout.flush()
        while server.poll() is None:
            time.sleep(0.5)
        raise UiError(f"prefect server exited ({server.returncode})")
    except KeyboardInterrupt:
        return 0
    finally:
        stop_server(server)
