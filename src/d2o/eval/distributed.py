"""`d2o eval --ray`: a sweep's samples spread over Ray workers, one model each.

Each worker (a Ray actor) loads the model once, on a GPU of its own where the cluster has GPUs,
and answers whole jobs: the samples that share one context, under every run they still need, so
the one shared prefill (and under ``--protocol context`` the one compression) stays within a
worker. The driver keeps ``samples.jsonl``: it appends each job's lines as the job returns, so an
interrupted sweep resumes from the jobs it has, as a sweep in one process does. On a cluster,
every node needs d2o installed (and the model at the same path, or an embedded one).
"""

from __future__ import annotations

from collections.abc import Iterator


class Worker:
    """One model and the sweep's methods; ``run`` answers one job into result lines. ``prepare``:
    the sweep's (task, methods by name) of its configuration, made in the worker."""

    def __init__(self, config, prepare, threads: int):
        import torch

        from d2o.eval.runner import Runner
        from d2o.models import load_model

        torch.set_num_threads(threads)
        self.task, methods = prepare(config)
        model, tokenizer = load_model(config.model, dtype=config.dtype, attention=config.attention,
                                      device="cuda" if torch.cuda.is_available() else None)
        self.runner = Runner.of(model, tokenizer, methods, config)

    def run(self, index: int, samples, ids, questions, todos) -> tuple[int, list[dict]]:
        from d2o.eval.results import result_line

        return index, [result_line(self.task, sample, outcome)
                       for sample, outcome in self.task.run(self.runner, samples, ids, questions, todos)]


def run_on_ray(config, jobs: list[tuple], prepare) -> Iterator[tuple[list, list[dict]]]:
    """Each job's samples and result lines, in the order the workers finish them. ``jobs``:
    (samples sharing a context, its token ids, their questions, their runs to do)."""
    import ray
    from ray.util import ActorPool

    from d2o import cluster
    from d2o.errors import D2OError

    cluster.connect(config.ray, cpus=config.workers)
    try:
        resources = ray.cluster_resources()
        gpus = 1 if resources.get("GPU", 0) >= config.workers else 0
        cpus = max(1, int(resources.get("CPU", 1) // config.workers))
        actor = ray.remote(Worker).options(num_cpus=cpus, num_gpus=gpus)
        pool = ActorPool([actor.remote(config, prepare, cpus) for _ in range(config.workers)])
        try:
            for index, lines in pool.map_unordered(lambda worker, job: worker.run.remote(*job),
                                                   [(i, *job) for i, job in enumerate(jobs)]):
                yield jobs[index][0], lines
        except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as error:
            cause = getattr(error, "cause", None)  # a worker's D2OError (met there first) as itself
            if isinstance(cause, D2OError):
                raise D2OError(str(cause)) from None
            raise D2OError(f"a Ray worker failed: {str(error).strip().splitlines()[-1]}") from None
    finally:
        cluster.disconnect()
