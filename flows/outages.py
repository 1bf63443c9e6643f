"""An outage outside lowerflow (the artifact store or Redis unreachable) as one line per model.

A stopped S3 endpoint fails every stage that touches the store with botocore's
message, the same for each target and again for the manifest's write.  The CLI
prints one line for it (``lowerflow: error: cannot reach the artifact store ...``);
:func:`mark_outage` gives a model manifest that same line, so a deployment run
says it once per model too: in the model run's log, its report, the fleet's log
and summary::

    before  targets.portable.error   export: EndpointConnectionError: Could not connect to the endpoint
                                     URL: "http://minio:9000/bucket/nightly/objects/05/1841d6ec…"
            targets.reference.error  (the same)
            store_error              cannot write the manifest to s3://bucket/nightly: EndpointConnectionError: …
    after   error                    cannot reach the artifact store s3://bucket/nightly: Could not connect to
                                     the endpoint URL: "http://minio:9000"; check that it is up and reachable
                                     (AWS_ENDPOINT_URL_S3 for S3), then run again: finished stages are reused
            targets.*.error          export: cannot reach the artifact store
            store_error              cannot write the manifest: cannot reach the artifact store

Redis down (the stage locks' server, tasks.locks.LocksUnavailable) likewise:
``cannot reach the stage locks' Redis redis://host:6379/0: ConnectionError: …; check …``.
"""

from __future__ import annotations

import re

#: botocore's EndpointConnectionError / ConnectTimeoutError: the S3 store is down or unreachable.
STORE_DOWN_NEEDLES = ("Could not connect to the endpoint URL", "Connect timeout on endpoint URL")
#: What a target's or a write's error becomes; the model's ``error`` has the whole line.
UNREACHABLE = "cannot reach the artifact store"
STORE_DOWN = (UNREACHABLE + "{store}: {cause}; check that it is up and reachable "
              "(AWS_ENDPOINT_URL_S3 for S3), then run again: finished stages are reused")
#: An object's URL in botocore's message: only its endpoint (scheme, host, port) is kept.
_URL = re.compile(r'"(https?://[^/"]+)/[^"]*"')
#: tasks.locks.LocksUnavailable's message: Redis, the stage locks' server, is down.
_LOCKS = re.compile(r"cannot take stage lock \S+ on (\S+): (.*)")
LOCKS_UNREACHABLE = "cannot reach the stage locks' Redis"
LOCKS_DOWN = (LOCKS_UNREACHABLE + " {url}: {cause}; check that it is up and reachable (LOWERFLOW_LOCKS, or "
              "locks: in the manifest), then run again: finished stages are reused")


def store_down(text: str, store: str | None = None) -> str | None:
    """The one line for an error whose cause is an unreachable store (None: it is not):
    what failed to connect (the endpoint) and what to do."""
    for needle in STORE_DOWN_NEEDLES:
        if needle in text:
            cause = text[text.index(needle):].splitlines()[0].split("; ")[0]
            return STORE_DOWN.format(store=f" {store}" if store else "", cause=_URL.sub(r'"\1"', cause))
    return None


def outage(text: str, store: str | None = None) -> tuple[str, str] | None:
    """(the one line, its short form) for an error caused by an unreachable store or
    Redis (the stage locks' server); None for any other error."""
    if (line := store_down(text, store)) is not None:
        return line, UNREACHABLE
    if (match := _LOCKS.search(text)) is not None:
        return LOCKS_DOWN.format(url=match.group(1), cause=match.group(2).strip().rstrip(".")), LOCKS_UNREACHABLE
    return None


def mark_outage(manifest: dict, store: str) -> bool:
    """If a target or the manifest's write failed because ``store`` (or Redis) is
    unreachable, give the manifest that one line as its ``error`` and shorten the
    others (see above).  Returns whether it did."""
    targets = manifest.get("targets") or {}
    texts = [str(r.get("error") or "") for r in targets.values()] + [str(manifest.get("store_error") or "")]
    found = next((o for text in texts if (o := outage(text, store))), None)
    if found is None:
        return False
    manifest["error"], short = found
    for result in targets.values():
        if outage(str(result.get("error") or "")):
            stage = str(result["error"]).split(": ", 1)[0]
            result["error"] = f"{stage}: {short}" if stage != result["error"] else short
    if outage(str(manifest.get("store_error") or "")):
        manifest["store_error"] = f"cannot write the manifest: {short}"
    return True
