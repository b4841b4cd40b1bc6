"""The same application on Ray Serve: 2 CPU replicas behind Ray's proxy, on loopback.

Skipped without the optional ``ray`` extra (``pip install 'd2o[ray]'``). One private local Ray for
the module (address="local", its own temp folder, no dashboard): never run two of these at once.
"""

from __future__ import annotations

import os
import socket
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'd2o[ray]')")
yaml = pytest.importorskip("yaml")

from d2o.runtime.generation import generate  # noqa: E402

with warnings.catch_warnings():  # Ray's own modules warn about pydantic and their own APIs on import
    warnings.simplefilter("ignore")
    from d2o.serve import ray_serve

pytestmark = pytest.mark.real_model
CONFIG = Path(__file__).parents[1] / "docs" / "serve-ray.yaml"


@pytest.fixture(scope="module")
def proxy():
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by every Ray worker
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    application = yaml.safe_load(CONFIG.read_text())["applications"][0]
    args = {**application["args"], "kv_memory": "64MB"}  # the documented config, with a test-sized cap
    ray_serve.start(ray_serve.build_app(args), "127.0.0.1", port, cpus=2)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        ray_serve.stop()


def test_both_replicas_answer_through_the_proxy_as_generate_would(proxy, real_model):
    model, tokenizer = real_model
    api = openai.OpenAI(base_url=proxy + "/v1", api_key="none", max_retries=0, timeout=120)
    prompts = [f"The {n} most famous cities in Europe are" for n in ("two", "three", "four", "five")] * 3

    def ask(prompt):
        return api.completions.create(model="smollm2", prompt=prompt, max_tokens=4, temperature=0)

    expected = generate(model, tokenizer, prompts[:4], "d2o", 0.2, max_new_tokens=4).texts * 3
    engines = set()
    for _ in range(3):  # Ray's router picks a replica per request by queue length: on a loaded host
        # one round of 12 may all go to one of them, so a round is repeated until both have answered
        with ThreadPoolExecutor(len(prompts)) as pool:
            replies = list(pool.map(ask, prompts))
        assert [r.choices[0].text for r in replies] == expected
        engines |= {r.system_fingerprint for r in replies}
        if len(engines) == 2:
            break
    assert len(engines) == 2  # two engines served them

    events = list(api.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi!"}],
                                              max_tokens=4, temperature=0, stream=True))
    assert events[-1].choices[0].finish_reason in ("stop", "length")
    reply = httpx.post(proxy + "/v1/completions", json={"model": "smollm2", "prompt": "hi", "kv_budget": 7})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "kv_budget"
    metrics = dict(line.rsplit(" ", 1) for line in httpx.get(proxy + "/metrics").text.splitlines()
                   if not line.startswith("#"))
    assert float(metrics["d2o_kv_bytes_cap"]) == 64e6
