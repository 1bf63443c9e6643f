"""lowerflow's Prefect flows: one model (``lower_model``) and a fleet (``lower_fleet``).

Importing this package before Prefect gives Prefect's ephemeral API server a
startup timeout that fits a busy machine (180 s instead of Prefect's 20 s: its
first start creates the database), unless the user set one.
"""

import os as _os

_os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
