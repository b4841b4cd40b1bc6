"""How long a server's prefills and decode steps take, in the rounds and on the prefill thread.

The documents workload of ``d2o bench serve`` (2 documents x 8 questions under 64 MB, ``d2o-novelty``
at 20%, a prefix cache of 32 MB, chunks of 256), once with the server prefilling in its rounds and
once on a thread of its own (``--prefill-thread``): the seconds spent in the engine's prefills
(``Engine._prefill_next``) and in its lanes' steps (``Engine._step``) beside the run's own.

    .venv/bin/python benchmarks/serve_busy.py
"""

from __future__ import annotations

import collections
import time

import d2o
from d2o.bench.serve import bench_serve
from d2o.options import parse_bytes
from d2o.serve.engine import Engine


def main() -> None:
    busy: collections.Counter = collections.Counter()
    for name, attribute in (("prefills", "_prefill_next"), ("steps", "_step")):
        original = getattr(Engine, attribute)

        def timed(*args, _original=original, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                busy[_name] += time.perf_counter() - start

        setattr(Engine, attribute, timed)
    model, tokenizer = d2o.load_model("smollm2")
    print("| prefill | seconds | prefills, s | steps, s | most running at once | requests/s |")
    print("|---|---|---|---|---|---|")
    for thread in (False, True):
        busy.clear()
        row, = bench_serve(model, tokenizer, [("d2o-novelty", "0.2")], parse_bytes("64MB"), clients=16, requests=16,
                           prompt_tokens=1500, max_tokens=24, kind="documents", documents=2, questions=8,
                           prefix_cache=(parse_bytes("32MB"),), prefill_chunks=(256,), prefill_threads=(thread,))
        print(f"| {'on its thread' if thread else 'in the rounds'} | {row['seconds']} | {busy['prefills']:.1f} | "
              f"{busy['steps']:.1f} | {row['peak_running']} | {row['requests_per_s']} |")


if __name__ == "__main__":
    main()
