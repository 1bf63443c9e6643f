"""The warm parent's warm-ups: per-process work done once before it forks, not in every run.

:func:`flows.warm_start.serve` calls each function its ``WARM_UP`` names after the
preloads, on one torch thread, then checks its sources for staleness with the modules'.
Here: one verified TLS context shared by Prefect's API clients
(:func:`share_api_tls_context`, also used by the worker process), Prefect's deferred
pydantic schemas built (:func:`build_prefect_schemas`), the server's version checked
once (:func:`check_api_version`), a first lowering of a small model
(:func:`lower_a_small_model`) and a first picture drawn (:func:`draw_a_picture`).
Each only makes runs faster: a failed or skipped warm-up leaves the work to the runs.
"""

from __future__ import annotations

import os
import sys

#: Set (by the warm parent itself) when its warm-up lowering left a native thread behind:
#: it then re-executes without it, since a forked child must not inherit threads.
NO_WARM_LOWERING_ENV = "LOWERFLOW_WARM_NO_LOWERING"


#: The Prefect version whose API clients :func:`share_api_tls_context` was written against.
TLS_PREFECT_VERSION = "3.8.8"


def share_api_tls_context() -> None:
    """Make Prefect's verified TLS context once per CA file, not once per API client.

    Prefect 3.8.8 builds a new ``ssl.create_default_context(cafile=...)`` for each
    ``PrefectClient``/``SyncPrefectClient`` (35-40 ms: it parses ~150 CA certificates),
    and a flow run makes about eight of them: 0.3 s of CPU a run (py-spy, issue 9).
    After this, a client made with Prefect's own TLS settings (no ``verify`` of its own,
    not ``PREFECT_API_TLS_INSECURE_SKIP_VERIFY``) gets the context that the same call made
    for the same CA file (``PREFECT_API_SSL_CERT_FILE``, else certifi's bundle) before:
    the warm parent makes the one its settings name, so every child starts with it.
    Prefect never changes a context it is given.  Only on the Prefect version this was
    checked against.
    """
    import ssl

    import certifi
    import prefect
    from prefect.client import orchestration
    from prefect.settings import PREFECT_API_SSL_CERT_FILE, PREFECT_API_TLS_INSECURE_SKIP_VERIFY

    if prefect.__version__ != TLS_PREFECT_VERSION:
        return
    contexts: dict[str, ssl.SSLContext] = {}

    def verified_context(cafile: str) -> ssl.SSLContext:
        if cafile not in contexts:
            contexts[cafile] = ssl.create_default_context(cafile=cafile)
        return contexts[cafile]

    def sharing(init):
        def __init__(self, *args, httpx_settings=None, **kwargs):
            if not (httpx_settings or {}).get("verify") and not PREFECT_API_TLS_INSECURE_SKIP_VERIFY.value():
                cafile = PREFECT_API_SSL_CERT_FILE.value() or certifi.where()
                httpx_settings = {**(httpx_settings or {}), "verify": verified_context(cafile)}
            init(self, *args, httpx_settings=httpx_settings, **kwargs)

        __init__.__wrapped__ = init
        return __init__

    for client in (orchestration.PrefectClient, orchestration.SyncPrefectClient):
        if not hasattr(client.__init__, "__wrapped__"):
            client.__init__ = sharing(client.__init__)
    verified_context(PREFECT_API_SSL_CERT_FILE.value() or certifi.where())


def build_prefect_schemas() -> None:
    """Complete every Prefect pydantic model whose schema is still deferred.

    Prefect defines its client models (flow runs, deployments, events, artifacts, ...)
    with their validators built on first use, and a forked child that validates one
    builds it again: 30-40 ms per model, ~10% of a cached fleet member's CPU (py-spy,
    issue 9).  Built here once (0.15 s for ~260 models), every child has them.
    """
    import pydantic

    models, stack = set(), [pydantic.BaseModel]
    while stack:
        for model in stack.pop().__subclasses__():
            if model not in models:
                models.add(model)
                stack.append(model)
    for model in sorted(models, key=lambda m: (m.__module__, m.__qualname__)):
        if model.__module__.startswith("prefect.") and not model.__pydantic_complete__:
            model.model_rebuild(raise_errors=False)  # one that cannot be built yet stays lazy


def check_api_version() -> None:
    """Ask the Prefect server its version once, here, so that no child asks it again.

    Prefect checks the server's version once per process and API URL (a GET of
    ``/admin/version``; the events subscriber that watches a deployment run for
    suspension also builds a TLS context of its own for it), before the flow starts:
    0.1 s of CPU and a round trip in every flow run (py-spy, issue 9).  Done once in
    the warm parent, every child inherits Prefect's "already checked" record, as every
    client of one long-lived Prefect worker process does.  A child whose settings name
    another API URL checks it itself; so do all children if the server cannot be
    reached now, or its major version differs (the child then fails as Prefect would).
    Only on the Prefect version this was checked against.
    """
    import prefect

    if prefect.__version__ != TLS_PREFECT_VERSION:
        return
    from prefect._internal import version_checking
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        return
    try:
        with get_client(sync_client=True) as client:
            client.raise_for_api_version_mismatch_once()  # records str(client.api_url)
    except Exception:
        return
    # The events and logs clients key the record on the setting as written.
    version_checking._cache_api_version_check(version_checking._api_version_check_key(url, prefect.__version__))


def lower_a_small_model() -> None:
    """Export, serialize and lower a small model to every built-in target, once, in the
    warm parent: what torch and lowerflow do lazily on a process's first lowering
    (decomposition tables, operator lookups, the serializer's and partitioners' first
    calls) then happens once per worker, not in every run.  Measured on forked
    children: 0.25-0.9 s less a model (mlp 0.45 -> 0.17 s, mobilenet_v2 5.7 -> 4.8 s).

    :func:`flows.warm_start.serve` runs it on one torch thread: no OpenMP pool is
    started, so children fork with none.  If native threads appeared anyway, the parent
    re-executes itself without this warm-up."""
    import threading

    import torch
    from torch import nn
    from torch.nn import functional as F

    if os.environ.get(NO_WARM_LOWERING_ENV):
        return
    from lowering import export, lower
    from lowering.serialize import deserialize_any, serialize_any
    from lowering.targets import PORTABLE, partitioner_for

    class Small(nn.Module):
        """A conv net's and a transformer's usual layers."""

        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
            self.embed, self.norm, self.mlp = nn.Embedding(10, 8), nn.LayerNorm(8), nn.Linear(8, 8)

        def forward(self, image: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            x = self.norm(self.embed(ids))
            x = F.scaled_dot_product_attention(x, x, x) + F.gelu(self.mlp(x))
            return x.softmax(-1).mean() + self.conv(image).flatten().sum()

    def native_threads() -> int:
        return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()

    before = native_threads()
    try:
        model, inputs = Small().eval(), (torch.randn(1, 3, 8, 8), torch.arange(6).reshape(1, 6))
        program = export(model, inputs)
        serialized = serialize_any(program)
        deserialize_any(serialized.manifest, serialized.get_blob)
        for target in (PORTABLE, "reference", "xnnpack"):
            lower(model, inputs, partitioner=partitioner_for(target))
    except Exception as exc:  # a warm-up only makes runs faster: never a reason not to serve them
        print(f"lowerflow warm start: the warm-up lowering failed ({type(exc).__name__}: {exc}); "
              "runs will do torch's first-lowering work themselves", file=sys.stderr)
    if native_threads() > before:
        os.environ[NO_WARM_LOWERING_ENV] = "1"
        os.execv(sys.executable, [sys.executable, "-m", "flows.warm_start", *sys.argv[1:]])


def draw_a_picture() -> None:
    """Load the report pictures' fonts and draw and encode a small PNG (no threads)."""
    import io

    from PIL import Image, ImageDraw

    from flows.report_pictures import FONT_PIXELS, picture_font

    image = Image.new("RGB", (40, 20), "white")
    for pixels in FONT_PIXELS:
        ImageDraw.Draw(image).text((1, 1), "warm", font=picture_font(pixels), fill="black")
    image.save(io.BytesIO(), format="PNG")
