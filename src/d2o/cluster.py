"""Ray for this process: a private local Ray (its own temp folder, no dashboard), or a cluster's.

Used by ``d2o serve --replicas`` and ``d2o eval --ray``; needs ``pip install 'd2o[ray]'``.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from d2o.errors import D2OError

# Quiet and private: no usage reporting, no auth token written into $HOME (recent Ray enables it).
QUIET = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
_temp: list[str] = []  # the temp folder of the local Ray this process started


def connect(address: str = "local", cpus: int | None = None) -> None:
    """``local``: start a private local Ray of ``cpus`` CPUs (all by default); else join the Ray
    cluster at ``address`` (``auto``: the one running on this machine; ``HOST:PORT``;
    ``ray://HOST:PORT`` for Ray Client)."""
    try:
        import ray
    except ImportError:
        raise D2OError("Ray is not installed: pip install 'd2o[ray]'") from None
    os.environ.update(QUIET)
    if address == "local":
        _temp.append(tempfile.mkdtemp(prefix="d2o-ray-"))  # short: Ray's socket paths live in it
        ray.init(address="local", num_cpus=cpus or os.cpu_count() or 1, include_dashboard=False,
                 log_to_driver=False, logging_level="WARNING", object_store_memory=100 * 2**20, _temp_dir=_temp[-1])
        return
    try:
        ray.init(address=address, log_to_driver=False, logging_level="WARNING")
    except (ConnectionError, ValueError, RuntimeError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise D2OError(f"cannot join a Ray cluster at {address!r}: {first}") from None


def disconnect() -> None:
    """Leave Ray (a local Ray this process started stops, its temp folder and logs removed)."""
    import ray

    ray.shutdown()
    while _temp:
        shutil.rmtree(_temp.pop(), ignore_errors=True)
