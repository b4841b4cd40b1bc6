"""Is a needle lost in chunks lost by what the cache keeps, or by the keys and values it keeps?

For RULER samples, the context (the prompt before its question) compressed in chunks, then asked;
then the same context prefilled whole into a full cache, each global layer cut down to exactly the
tokens the chunked cache kept there (sliding-window layers hold their window either way), and asked
again. The second answer has the chunked prefill's choice of tokens with the whole prefill's keys
and values. With ``--passkey N``: passkey prompts of N tokens (the question in the prompt, shown
after every chunk), and how many of the key's tokens each global layer holds after the prefill.

    .venv/bin/python benchmarks/chunked_kept.py --task niah_single_1 --samples 4 --budget 0.1
    .venv/bin/python benchmarks/chunked_kept.py --passkey 16384 --samples 2 --methods d2o-plus-words,d2o-novelty
"""

from __future__ import annotations

import argparse
import random

import torch

import d2o
from d2o.data import essays
from d2o.eval.tasks.passkey import make_passkey_prompt
from d2o.eval.tasks.ruler import Ruler
from d2o.models import load_model
from d2o.runtime.context import compress_ids
from d2o.runtime.decoding import Batch, Sequence


def passkeys(model, tokenizer, args) -> None:
    """Per passkey prompt and method: the key's tokens each global layer holds after a prefill in
    chunks, and the answer."""
    rng = random.Random(args.seed)
    print("| key | method | key tokens held per global layer | answer |")
    print("|---|---|---|---|")
    for _ in range(args.samples):
        prompt = make_passkey_prompt(tokenizer, essays(), args.passkey, rng)
        encoded = tokenizer(prompt.text, return_offsets_mapping=True)
        at = prompt.text.index(prompt.key)
        key = {i for i, (start, end) in enumerate(encoded.offset_mapping) if start < at + len(prompt.key) and end > at}
        for name in args.methods.split(","):
            cache = d2o.CompressedCache(model, d2o.get_method(name), d2o.Budget.parse(args.budget),
                                        tokenizer=tokenizer, prefill_chunk=args.chunk)
            sequence = Sequence(tokenizer, args.max_new_tokens)
            run = Batch.prefill(model, cache, [encoded.input_ids], [sequence])
            held = [len(key & set(layer.token_index[0, 0].tolist())) for layer in cache.layers if layer.window is None]
            run.run()
            print(f"| {prompt.key} | {name} | {', '.join(f'{n} of {len(key)}' for n in held)} | "
                  f"{sequence.text.strip().splitlines()[0]!r} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--task", default="niah_single_1")
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--method", default="d2o-novelty")
    parser.add_argument("--budget", default="0.1")
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--passkey", type=int, help="passkey prompts of this many tokens instead of RULER's")
    parser.add_argument("--methods", default="d2o-plus-words,d2o-novelty", help="with --passkey")
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    if args.passkey:
        passkeys(model, tokenizer, args)
        return
    method = d2o.get_method(args.method)
    samples = Ruler(length=args.length, tasks=(args.task,)).samples(tokenizer, args.samples, args.seed)
    print("| sample | gold | in chunks | whole keys and values, the chunked cache's tokens |")
    print("|---|---|---|---|")
    for sample in samples:
        context = sample.prompt[: len(sample.prompt) - len(sample.question)]
        ids = tokenizer(context, add_special_tokens=sample.special_tokens).input_ids
        chunked = compress_ids(model, tokenizer, ids, method, d2o.Budget.parse(args.budget), prefill_chunk=args.chunk)
        kept = {i: layer.token_index[0, 0][layer.token_index[0, 0] >= 0].sort().values
                for i, layer in enumerate(chunked.cache.layers) if layer.window is None}
        whole = compress_ids(model, tokenizer, ids, method, d2o.Budget.parse("1.0"))
        for i, layer in enumerate(whole.cache.layers):
            if i in kept:  # a full cache of one row: slot j holds token j
                slots = kept[i][None, None, :]
                layer.keep(slots, torch.ones(1, slots.shape[-1], dtype=torch.bool))
        answers = [context.ask(sample.question, max_new_tokens=args.max_new_tokens).text.strip().splitlines()[0]
                   for context in (chunked, whole)]
        print(f"| {sample.id} | {', '.join(sample.gold)} | {answers[0]!r} | {answers[1]!r} |", flush=True)


if __name__ == "__main__":
    main()
