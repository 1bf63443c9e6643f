"""One thread at a time in torch, per process.

``torch.export`` switches process-wide state while it traces, and every other
thread's torch calls see it::

    thread A (export stage)              thread B (loading another model)
    torch.export.export(m)               nn.Linear(...)  # a head the checkpoint lacks
      is_exporting() ─► True  ──────────►  is_compiling() is True here too
      python dispatcher on   ──────────►  normal_ ─► torch._refs.normal (other random numbers)
      fx annotate(current_meta)  ◄──────►  annotate(current_meta) ─► KeyError: 'custom'

so a model loaded beside an export can fail, get other weights, or take a model's
export-only code paths in eager.  A fleet runs its models on threads: every stage
body and every model load holds :data:`TORCH_LOCK`.  The bodies are GIL-bound
Python anyway; threads still overlap store I/O and Prefect API calls, and
processes (or a Dask task runner) are the way to scale a fleet.
"""

from __future__ import annotations

import threading

#: Held by each stage body (:mod:`tasks.stages`) and each model load (:mod:`tasks.model_spec`).
#: Re-entrant: a stage body loads its model again on a cache miss of the live model.
TORCH_LOCK = threading.RLock()
