"""``deployments/server.sh`` without Prefect, and the systemd units (issue 23).

* ``db`` with a data directory and port of its own, then ``status``, ``psql`` and
  ``stop`` given only ``LOWERFLOW_HOME``: they act on what ``db`` started (remembered in
  ``$LOWERFLOW_HOME/server.env``), and ``stop`` stops PostgreSQL;
* a first start whose initdb fails leaves no data directory behind;
* ``start`` installs the automations (``lowerflow automations install``, with
  LOWERFLOW_ZOMBIE_WINDOW and LOWERFLOW_NOTIFY_URL) once the API answers, at every start;
* the unit files of deployments/systemd pass ``systemd-analyze verify`` (with the
  checkout's paths in place of /opt/lowerflow) with no warning.

The end-to-end use of ``server.sh start`` is tests/test_deployment.py's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.test_deployment import no_postgres_user, free_port, postgres_bindir

ROOT = Path(__file__).resolve().parent.parent
SERVER_SH = ROOT / "deployments" / "server.sh"
UNITS = ROOT / "deployments" / "systemd"

def needs_postgres(test):
    test = pytest.mark.skipif(postgres_bindir() is None, reason="PostgreSQL is not installed (CI installs it)")(test)
    return pytest.mark.skipif(no_postgres_user(),
                              reason="running as root and there is no `postgres` user to run PostgreSQL")(test)


@pytest.fixture
def home():
    """A LOWERFLOW_HOME the `postgres` user can reach when the tests run as root."""
    base = Path(tempfile.mkdtemp(prefix="lf-sh-"))
    base.chmod(0o755)
    yield base
    subprocess.run([str(SERVER_SH), "stop"], env=_env(base), capture_output=True, timeout=120)
    shutil.rmtree(base, ignore_errors=True)


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOWERFLOW_PGDATA", "LOWERFLOW_PG_PORT", "HOST", "PORT", "LOWERFLOW_PG_BINDIR")}
    return {**env, "LOWERFLOW_HOME": str(home), **extra}


def server_sh(home: Path, *args: str, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(SERVER_SH), *args], env=_env(home, **extra), capture_output=True, text=True,
                          timeout=180)


@needs_postgres
def test_every_command_acts_on_what_db_started_and_stop_stops_postgres(home):
    pgdata, port = home / "elsewhere", free_port()
    started = server_sh(home, "db", LOWERFLOW_PGDATA=str(pgdata), LOWERFLOW_PG_PORT=str(port), HOST="0.0.0.0",
                        PORT="4311")
    assert started.returncode == 0, started.stderr
    assert f"@127.0.0.1:{port}/prefect" in started.stdout, started.stdout
    remembered = (home / "server.env").read_text()
    assert f"LOWERFLOW_PGDATA={pgdata}\n" in remembered and f"LOWERFLOW_PG_PORT={port}\n" in remembered, remembered
    assert "PORT=4311\n" in remembered and "HOST=0.0.0.0\n" in remembered, remembered

    status = server_sh(home, "status")  # no LOWERFLOW_PGDATA, no port: the remembered ones
    assert status.returncode == 1, status  # the Prefect server is not running
    assert f"postgres: running in {pgdata} on 127.0.0.1:{port}" in status.stdout, status.stdout
    psql = server_sh(home, "psql", "-tA", "-c", "SELECT current_database()")
    assert psql.returncode == 0 and psql.stdout.split() == ["prefect"], psql

    stopped = server_sh(home, "stop")
    assert stopped.returncode == 0 and f"stopping PostgreSQL ({pgdata})" in stopped.stderr, stopped.stderr
    assert not (pgdata / "postmaster.pid").exists()
    status = server_sh(home, "status")
    assert status.returncode == 1 and f"postgres: not running ({pgdata})" in status.stdout, status.stdout
    assert not (home / "postgres").exists()  # the default directory was never touched


@needs_postgres
def test_a_failed_first_start_leaves_no_data_directory(home):
    # An initdb that fails (as one does for a data directory PostgreSQL's user cannot use).
    bindir = home / "bin"
    bindir.mkdir()
    for tool in ("initdb", "pg_ctl", "psql"):
        (bindir / tool).write_text("#!/bin/sh\necho 'initdb: error: could not create directory' >&2\nexit 1\n")
        (bindir / tool).chmod(0o755)
    pgdata = home / "deep" / "postgres"
    result = server_sh(home, "db", LOWERFLOW_PGDATA=str(pgdata), LOWERFLOW_PG_BINDIR=str(bindir))
    assert result.returncode == 1 and "initdb failed" in result.stderr, result.stderr
    assert not pgdata.exists(), list(pgdata.iterdir())
    # A second try with the real PostgreSQL starts from zero (no "not empty" refusal).
    result = server_sh(home, "db", LOWERFLOW_PGDATA=str(pgdata), LOWERFLOW_PG_PORT=str(free_port()))
    assert result.returncode == 0, result.stderr
    assert (pgdata / "PG_VERSION").exists()


FAKE_PREFECT = """#!{python}
# `prefect server start --host H --port P` standing in for Prefect: its API answers after a second.
import http.server, sys, time

port = int(sys.argv[sys.argv.index("--port") + 1])
time.sleep(1)


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"true")

    def log_message(self, *args):
        pass


http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


@needs_postgres
def test_start_installs_the_automations_once_the_api_answers(home):
    import sys
    import time

    record = home / "lowerflow.calls"
    (home / "prefect").write_text(FAKE_PREFECT.format(python=sys.executable))
    # The lowerflow command beside prefect (as in a venv), recording how it was called.
    (home / "lowerflow").write_text(f"#!/bin/sh\necho \"$PREFECT_API_URL $*\" >>'{record}'\n"
                                    "echo \"installed automation 'lowerflow: crash zombie flow runs' (1)\"\n")
    for tool in ("prefect", "lowerflow"):
        (home / tool).chmod(0o755)
    port = free_port()
    settings = dict(LOWERFLOW_PGDATA=str(home / "pg"), LOWERFLOW_PG_PORT=str(free_port()), PORT=str(port),
                    PREFECT=str(home / "prefect"))
    expected = []
    for extra, args in (({"LOWERFLOW_NOTIFY_URL": "http://hooks.test/night", "LOWERFLOW_ZOMBIE_WINDOW": "45"},
                         "automations install --zombie-window 45 --notify-url http://hooks.test/night"),
                        ({}, "automations install")):  # the second start: again (install is idempotent)
        server = subprocess.Popen([str(SERVER_SH), "start"], env=_env(home, **settings, **extra),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        expected.append(f"http://127.0.0.1:{port}/api {args}")
        deadline = time.monotonic() + 120
        while not (record.exists() and len(record.read_text().splitlines()) == len(expected)):
            assert server.poll() is None and time.monotonic() < deadline, server.communicate(timeout=10)
            time.sleep(0.2)
        assert record.read_text().splitlines() == expected
        stopped = server_sh(home, "stop")
        assert stopped.returncode == 0, stopped.stderr
        _, err = server.communicate(timeout=30)
        assert "server.sh: installed automation 'lowerflow: crash zombie flow runs' (1)" in err, err


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed (no systemd)")
def test_systemd_units_verify(tmp_path):
    """The units, with this checkout and its venv in place of /opt/lowerflow, verify cleanly."""
    import sys

    venv = Path(sys.executable).parent.parent
    assert (venv / "bin" / "lowerflow").exists(), "the lowerflow console script (pip install -e .)"
    units = []
    for unit in sorted(UNITS.glob("*.service")):
        text = unit.read_text().replace("/opt/lowerflow/.venv", str(venv)).replace("/opt/lowerflow", str(ROOT))
        name = unit.name.replace("@.service", "@1.service")  # a template verifies as an instance
        (tmp_path / name).write_text(text)
        units.append(str(tmp_path / name))
        assert "Restart=" in text, unit.name
    assert len(units) == 3, units
    result = subprocess.run(["systemd-analyze", "verify", *units], capture_output=True, text=True, timeout=60)
    problems = [line for line in (result.stdout + result.stderr).splitlines() if str(tmp_path) in line
                or "lowerflow" in line]
    assert result.returncode == 0 and not problems, result.stdout + result.stderr
