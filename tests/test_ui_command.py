"""``lowerflow ui`` (issue 22): the reports of a CLI run, one command away.

A real ``lowerflow fleet`` runs on Prefect's ephemeral server in a PREFECT_HOME of
its own; then ``lowerflow ui`` starts a server on that same database.  It must
print the fleet report's address, serve that report's artifact through its API,
tell the UI where its API is (the UI is blank otherwise), and stop its server on
Ctrl-C.  A taken port is a one-line error.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_for(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "LOWERFLOW_"))}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONPATH=str(ROOT))
    return env


def lowerflow(*args: str, env: dict, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, **kw)


def read_lines_until(proc: subprocess.Popen, marker: str, timeout: float) -> list[str]:
    """Lines of ``proc``'s stdout up to the one holding ``marker`` (read on a thread)."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line.rstrip("\n")) for line in proc.stdout], daemon=True).start()
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            seen.append(lines.get(timeout=1.0))
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        if marker in seen[-1]:
            return seen
    raise AssertionError(f"no {marker!r} in {seen}; stderr: {proc.stderr.read() if proc.poll() is not None else ''}")


def get_json(url: str, body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as r:
        return json.loads(r.read())


def test_ui_serves_the_fleet_report_of_a_cli_run(tmp_path):
    home = tmp_path / "prefect-home"
    manifest = tmp_path / "fleet.yaml"
    manifest.write_text(textwrap.dedent(f"""\
        store: {tmp_path / 'store'}
        models:
          - name: mlp
            model: {ROOT / 'examples' / 'models.py'}:mlp
            targets: [portable]
        """))
    env = env_for(home)
    done = lowerflow("fleet", str(manifest), env=env, timeout=600)
    assert done.returncode == 0, done.stderr

    port = free_port()
    ui = subprocess.Popen([sys.executable, "-m", "flows.cli", "ui", "--port", str(port), "--verbose"], env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          # as a test runner's worker may pass it down (the suite failed so twice): Ctrl-C still stops it
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        lines = read_lines_until(ui, "serving", timeout=180)
        pairs = [[part.strip() for part in line.split(": ", 1)] for line in lines if ": " in line]
        links = {label: link for label, link in pairs if link.startswith("http")}
        base = f"http://127.0.0.1:{port}"
        assert links["fleet report"] == f"{base}/artifacts/key/lowerflow-fleet", lines
        assert links["last fleet"].startswith(f"{base}/runs/flow-run/"), lines
        assert links["model report mlp"].startswith(f"{base}/artifacts/artifact/"), lines  # --verbose
        assert "# lowerflow fleet" in lines and any(line.startswith("| mlp") or "[mlp]" in line for line in lines), lines
        # The report is the one this run published, served from the CLI's database.
        artifact = get_json(f"{base}/api/artifacts/latest/filter",
                            {"artifacts": {"key": {"any_": ["lowerflow-fleet"]}}, "limit": 1})[0]
        assert "mlp" in artifact["data"]
        run = get_json(f"{base}/api/flow_runs/{links['last fleet'].rsplit('/', 1)[1]}")
        assert run["state_type"] == "COMPLETED"
        # The UI is told where its API is.
        assert get_json(f"{base}/ui-settings")["api_url"] == f"{base}/api"

        # The port is taken now: a second `lowerflow ui` on it is one line, exit 2.
        second = lowerflow("ui", "--port", str(port), env=env, timeout=60)
        assert second.returncode == 2
        assert second.stderr.strip().splitlines() == [second.stderr.strip()]
        assert f"port {port}" in second.stderr
    finally:
        os.killpg(ui.pid, signal.SIGINT)
        # Stopping waits up to 15 s for the server's own shutdown, then kills it (flows.ui.stop_server).
        assert ui.wait(60) == 0
    with socket.socket() as s:  # the server went with it (nothing listens; closed connections may linger)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
