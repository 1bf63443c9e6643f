"""Shared fixtures: one Prefect test server per session, a moto S3 server, artifact stores.

The Prefect server (``prefect_test_harness``, ~8 s to start) is started only if a
test asks for ``prefect_api``.  The S3 server is moto in server mode on
127.0.0.1 with fake credentials given explicitly (no real AWS is ever contacted).
"""

from __future__ import annotations

import os
import uuid

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

#: The test files of two minutes or more (on a quiet 2-core machine, in ``./run test``), the
#: longest first.  ``./run test`` sends whole files to its workers (``--dist loadfile``) in
#: collection order (``--no-loadscope-reorder``; xdist's default order is by number of
#: tests, which put these few-test files last): these start first, and the files that
#: finish the run are short ones, so both workers end within a short file of each other.
#: (The first two run side by side: test_deployment.py mostly waits on its processes.)
LONGEST_FIRST = (
    "test_deployment.py",
    "test_et_identical_hf.py",  # Vela compiles of MobileNetV2 and BERT on both sides: ~5 min
    "test_hf_quantized.py",
    "test_verify_modes.py",
    "test_hf.py",
    "test_cli.py",
    "test_gates.py",
    "test_deployment_trial.py",
)


def pytest_collection_modifyitems(config, items):
    """The files of :data:`LONGEST_FIRST` first, in its order; then the others, the files of
    more tests first (xdist's own order), each file's tests in their order."""
    files: dict = {}
    for item in items:
        files.setdefault(item.path, []).append(item)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    order = sorted(files, key=lambda path: (rank.get(path.name, len(rank)), -len(files[path])))
    items[:] = [item for path in order for item in files[path]]


#: Fake credentials of the moto server; never real ones.
S3_KEY = "lowerflow-test"
S3_SECRET = "lowerflow-test-secret"


@pytest.fixture(scope="session")
def prefect_api():
    """A temporary Prefect server for the whole session; yields its API URL."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    # Prefect's default 30 s is too short for a first start on a busy 2-core machine.
    with prefect_test_harness(server_startup_timeout=180):
        yield PREFECT_API_URL.value()


@pytest.fixture
def fresh_stages(prefect_api):
    """A test of the cached stages: the Prefect server is up, and the test starts and ends
    with no live objects and no injected faults (``tasks.stages.LIVE`` / ``FAULTS``)."""
    from tasks import stages

    stages.LIVE.clear()
    stages.FAULTS.clear()
    yield stages
    stages.FAULTS.clear()
    stages.LIVE.clear()


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server on 127.0.0.1 (random port); yields its endpoint URL."""
    pytest.importorskip("s3fs")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(scope="session")
def s3_options(s3_endpoint):
    """fsspec storage options for the moto server, with a bucket ``lowerflow`` created."""
    import boto3

    boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        region_name="us-east-1",
        aws_access_key_id=S3_KEY,
        aws_secret_access_key=S3_SECRET,
    ).create_bucket(Bucket="lowerflow")
    return {
        "key": S3_KEY,
        "secret": S3_SECRET,
        "client_kwargs": {"endpoint_url": s3_endpoint, "region_name": "us-east-1"},
    }


@pytest.fixture(params=["local", "memory", "s3"])
def store(request, tmp_path):
    """An empty ArtifactStore on each kind of filesystem."""
    from tasks.store import ArtifactStore

    kind = request.param
    if kind == "local":
        yield ArtifactStore(str(tmp_path / "store"))
    elif kind == "memory":
        s = ArtifactStore(f"memory://lowerflow-{uuid.uuid4().hex}")
        yield s
        if s.fs.exists(s.root):
            s.fs.rm(s.root, recursive=True)
    else:
        options = request.getfixturevalue("s3_options")
        yield ArtifactStore(f"s3://lowerflow/{uuid.uuid4().hex}", **options)


#: What ``flows.cli.configure_environment`` may set; restored after each test.
CLI_ENV = ("LOWERFLOW_STORE", "PREFECT_SERVER_ANALYTICS_ENABLED", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS",
           "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "PREFECT_SERVER_LOGGING_LEVEL")


@pytest.fixture
def cli(monkeypatch, capsys):
    """``cli(*args)`` runs ``lowerflow ARGS`` in this process: (exit status, stdout, error lines)."""
    for name in CLI_ENV:  # monkeypatch puts back what main() changes
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])
        else:
            monkeypatch.delenv(name, raising=False)

    from flows.cli import main

    def run(*args: str) -> tuple[int, str, list[str]]:
        capsys.readouterr()
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return code, out, [line for line in err.splitlines() if line.startswith("lowerflow: error:")]

    return run
