"""Bit-for-bit digests of what the engine does, to compare two commits of a change meant to keep
behaviour (a reshape of the engine).

For every registered method, on the embedded model and on tiny random Llama and Gemma 3 configs,
both protocols (the question in the prompt: a padded batch of 3 prompts; asked after compression:
3 questions of different lengths on one compressed context), ``evict_every`` 1 and 8, ``kv_bits``
none and 4: after the prefill and after every decode step, a digest of every layer's token
indices, keys and values, and the tokens generated. Run it on each commit (the same script, the
same number of threads: float sums follow it), then compare the two files:

    python benchmarks/engine_parity.py --out before.json      # on the commit before
    python benchmarks/engine_parity.py --out after.json --against before.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch

import d2o
from d2o.budget import Budget
from d2o.errors import D2OError
from d2o.methods import REGISTRY
from d2o.runtime.context import compress_ids
from d2o.runtime.decoding import Batch, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import byte_tokenizer, random_ids, tiny_model  # noqa: E402

STEPS = 12
LENGTHS = {"smollm2": (300, 260, 220), "llama": (140, 110, 96), "gemma3": (140, 110, 96)}
QUESTIONS = (24, 17, 9)  # tokens of each question asked after compression


def digest(cache) -> str:
    """One hash of every layer's token indices, keys and values (the layers are left settled)."""
    hasher = hashlib.blake2b(digest_size=16)
    for layer in cache.layers:
        if layer.token_index is None:
            continue
        # The token indices as int64, whatever their stored width, so that commits storing them
        # differently compare.
        for tensor in (layer.token_index.long(), layer.keys, layer.values):
            hasher.update(tensor.detach().contiguous().cpu().numpy().tobytes())
        layer.settle()
    return hasher.hexdigest()


def run(batch: Batch) -> dict:
    """The digest after the prefill and after each step, and every row's tokens."""
    digests = [digest(batch.cache)]
    order = list(batch.sequences)
    while batch.sequences:
        batch.step()
        digests.append(digest(batch.cache))
    return {"digests": digests, "tokens": [sequence.tokens for sequence in order]}


def prompts_of(name: str, tokenizer) -> list[list[int]]:
    if name != "smollm2":
        return [random_ids(n, seed=n)[0].tolist() for n in LENGTHS[name]]
    from d2o.data import all_essay_tokens

    ids = all_essay_tokens(tokenizer, 2000)
    return [ids[i * 500 : i * 500 + n] for i, n in enumerate(LENGTHS[name])]


def case(model, tokenizer, name: str, method: str, protocol: str, evict_every: int, kv_bits) -> dict:
    policy = d2o.get_method(method)
    budget = Budget.parse("0.25", min_tokens=16)
    prompts = prompts_of(name, tokenizer)
    try:
        if protocol == "prompt":
            cache = d2o.CompressedCache(model, policy, budget, tokenizer=tokenizer, evict_every=evict_every,
                                        kv_bits=kv_bits)
            sequences = [Sequence(tokenizer, STEPS) for _ in prompts]
            return run(Batch.prefill(model, cache, prompts, sequences))
        context = compress_ids(model, tokenizer, prompts[0], policy, budget, evict_every=evict_every,
                               kv_bits=kv_bits)
        questions = [prompts[1][-n:] for n in QUESTIONS]
        batch = context.answer_batch(questions, [Sequence(tokenizer, STEPS) for _ in questions])
        return {"context": digest(context.cache), **run(batch)}
    except D2OError as error:
        return {"error": str(error)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--against", help="a file this script wrote on another commit: report what differs")
    parser.add_argument("--models", default="llama,gemma3,smollm2")
    parser.add_argument("--methods", default=",".join(REGISTRY))
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    results = {}
    for name in args.models.split(","):
        if name == "smollm2":
            model, tokenizer = d2o.load_model("smollm2")
        else:
            model, tokenizer = tiny_model(name), byte_tokenizer()
        for method in args.methods.split(","):
            for protocol in ("prompt", "context"):
                for evict_every in (1, 8):
                    for kv_bits in (None, 4):
                        key = f"{name}/{method}/{protocol}/k{evict_every}/bits{kv_bits}"
                        results[key] = case(model, tokenizer, name, method, protocol, evict_every, kv_bits)
                        print(key, "error" if "error" in results[key] else "ok", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    if args.against:
        before = json.loads(Path(args.against).read_text())
        differ = [key for key in results if key in before and before[key] != results[key]]
        missing = [key for key in before if key not in results]
        for key in differ:
            print("DIFFERS", key, json.dumps(before[key])[:300], "|", json.dumps(results[key])[:300])
        print(f"{len(results) - len(differ)} of {len(results)} cases equal bit for bit; {len(differ)} differ; "
              f"{len(missing)} of the other file's not run")
        sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
