"""The same application on Ray Serve: N replicas, each with its own model and engine (its own KV
memory cap), behind Ray's HTTP proxy, which spreads requests over them.

``d2o serve --replicas N`` starts a private local Ray; on a cluster, ``serve run`` a config whose
``import_path`` is ``d2o.serve.ray_serve:build_app`` (docs/guides/serving.md). Needs ``pip install 'd2o[ray]'``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import fields

from ray import serve

from d2o import cluster
from d2o.errors import D2OError
from d2o.options import parse_bytes
from d2o.serve.config import ServeConfig


@serve.deployment(max_ongoing_requests=256, graceful_shutdown_timeout_s=2, graceful_shutdown_wait_loop_s=0.5)
@serve.ingress()
class D2OServer:
    """One replica: loads the model and serves ``create_app(engine)``, the app ``d2o serve`` runs."""

    def __init__(self, config: ServeConfig):
        import torch

        from d2o.serve.engine import Engine

        if "OMP_NUM_THREADS" in os.environ:
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        self.engine = Engine.load(config)

    def __serve_build_asgi_app__(self):
        from d2o.serve.app import create_app

        return create_app(self.engine)

    def __del__(self):
        if hasattr(self, "engine"):
            self.engine.close()


def application(config: ServeConfig, replicas: int = 1, cpus: float = 1, gpus: float = 0):
    """The Serve application: ``replicas`` copies of the server, each given ``cpus`` and ``gpus``."""
    if replicas < 1:
        raise D2OError(f"replicas must be at least 1, got {replicas}")
    config.check()
    return D2OServer.options(num_replicas=replicas, ray_actor_options={"num_cpus": cpus, "num_gpus": gpus}).bind(config)


def build_app(args: dict):
    """For ``serve run``: the config's ``args`` are ServeConfig fields (``kv_memory: 512MB``) plus
    ``replicas``, ``cpus`` and ``gpus`` per replica."""
    args = dict(args)
    deployment = {name: args.pop(name) for name in ("replicas", "cpus", "gpus") if name in args}
    known = {f.name for f in fields(ServeConfig)}
    if set(args) - known:
        raise D2OError(f"unknown option(s) {', '.join(sorted(set(args) - known))}; known: {', '.join(sorted(known))}")
    if isinstance(args.get("kv_memory"), str):
        args["kv_memory"] = parse_bytes(args["kv_memory"])
    return application(ServeConfig(**args), **deployment)


def start(app, host: str, port: int, cpus: int | None = None) -> None:
    """A private local Ray (its own temp folder, no dashboard) running the Serve application
    ``app`` behind its proxy on ``host:port``; returns once every replica is up."""
    cluster.connect("local", cpus)
    serve.start(http_options={"host": host, "port": port}, logging_config={"log_level": "WARNING"})
    serve.run(app, name="d2o", route_prefix="/")


def stop() -> None:
    """Shut Serve and the local Ray down, and remove Ray's temp folder (its logs too)."""
    serve.shutdown()
    cluster.disconnect()


def run_replicas(config: ServeConfig, replicas: int, host: str, port: int) -> None:
    """``d2o serve --replicas N``: serve until SIGINT (Ctrl-C) or SIGTERM."""
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    start(application(config, replicas), host, port, cpus=max(replicas, os.cpu_count() or 1))
    print(f"d2o: {replicas} replicas of {config.model} behind http://{host}:{port}/v1 (Ctrl-C stops)", flush=True)
    done = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: done.set())
    try:
        done.wait()
    finally:
        stop()
