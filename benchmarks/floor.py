"""Which floor (``min_tokens``) keeps short prompts answering as with the full cache?

Short chat questions and short few-shot prompts, every registered method at the default budget
(0.2), greedy: for each floor, how many (method, prompt) pairs give the full cache's tokens.
The library's default is the smallest floor at which all of them do.

    python benchmarks/floor.py --floors 0,16,32,48,64,96,128 --max-new-tokens 16
"""

from __future__ import annotations

import argparse
import json

import torch

from d2o.budget import Budget
from d2o.engine.cache import CompressedCache
from d2o.errors import D2OError
from d2o.methods import REGISTRY, get_method
from d2o.models import load_model
from d2o.runtime.decoding import Batch, Sequence
from d2o.runtime.prompts import encode, stop_token_ids
from d2o.runtime.sharing import SharedPrefill

QUESTIONS = [
    "What is the capital of France?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Name the three primary colors.",
    "Who wrote Romeo and Juliet?",
    "What is the largest planet in the solar system?",
    "At what temperature does water boil, in degrees Celsius?",
    "What is the opposite of 'cold'?",
    "On which continent is Kenya?",
    "How many days are there in a week?",
]
FEW_SHOT = [
    "France: Paris\nJapan: Tokyo\nItaly: Rome\nCanada: Ottawa\nEgypt: Cairo\nSpain:",
    "hot -> cold\nbig -> small\nfast -> slow\nhappy -> sad\nlight -> dark\nup ->",
    "Review: The food was wonderful and the staff were kind.\nSentiment: positive\n\n"
    "Review: I waited an hour and the soup was cold.\nSentiment: negative\n\n"
    "Review: A lovely evening, we will come back.\nSentiment: positive\n\n"
    "Review: The room was dirty and noisy all night.\nSentiment:",
    "English: cat\nFrench: chat\n\nEnglish: house\nFrench: maison\n\nEnglish: water\nFrench: eau\n\n"
    "English: bread\nFrench:",
    "Q: Tom has 3 apples and buys 4 more. How many apples does he have?\nA: 3 + 4 = 7. The answer is 7.\n\n"
    "Q: A box holds 6 eggs. How many eggs are in 5 boxes?\nA: 6 * 5 = 30. The answer is 30.\n\n"
    "Q: Sara had 20 dollars and spent 8. How many dollars are left?\nA:",
]


def answers(model, tokenizer, ids: list[int], runs: list[tuple[str, Budget]], max_new: int) -> dict:
    """Greedy tokens of every (method, budget) run on one prompt, one prefill shared where possible."""
    stops = stop_token_ids(model, tokenizer)
    names = list(dict.fromkeys(name for name, _ in runs))
    shareable = [n for n in names if not REGISTRY[n].cls.repeats_kv_heads]
    shared = SharedPrefill(model, [get_method(n) for n in shareable])
    first = Batch.prefill(model, shared.cache, [ids], [Sequence(tokenizer, max_new, stop_ids=stops)])
    out = {}
    for name, budget in runs:
        sequence = Sequence(tokenizer, max_new, stop_ids=stops)
        try:
            get_method(name).check_budget(budget)
            if name in shareable:
                batch = Batch(model, shared.fork(shareable.index(name), budget), [sequence], first.logits,
                              first.positions)
            else:
                batch = Batch.prefill(model, CompressedCache(model, get_method(name), budget), [ids], [sequence])
            batch.run()
        except D2OError:  # a floor the method cannot work under is refused: never the full cache's answer
            out[(name, budget.min_tokens)] = None
            continue
        out[(name, budget.min_tokens)] = sequence.tokens
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--floors", default="0,16,32,48,64,96,128")
    parser.add_argument("--budget", default="0.2")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()
    floors = [int(f) for f in args.floors.split(",")]
    model, tokenizer = load_model("smollm2")
    prompts = [("chat", ids) for ids in encode(tokenizer, QUESTIONS, chat=True)]
    prompts += [("few-shot", ids) for ids in encode(tokenizer, FEW_SHOT)]
    methods = [name for name in REGISTRY if name != "full"]
    matches = {floor: 0 for floor in floors}
    misses = {floor: [] for floor in floors}
    with torch.inference_mode():
        for kind, ids in prompts:
            # A floor that holds the prompt and every token fed after it never compresses: no need to run.
            runs = [(n, Budget.parse(args.budget, f)) for n in methods for f in floors
                    if f < len(ids) + args.max_new_tokens - 1]
            got = answers(model, tokenizer, ids, [("full", Budget(ratio=1.0))] + runs, args.max_new_tokens)
            reference = got[("full", Budget(ratio=1.0).min_tokens)]
            for floor in floors:
                for name in methods:
                    same = got.get((name, floor), reference) == reference
                    matches[floor] += same
                    if not same:
                        misses[floor].append(f"{name}/{kind}{len(ids)}")
            print(f"{kind} prompt of {len(ids)} tokens done", flush=True)
    total = len(prompts) * len(methods)
    print(f"\nbudget {args.budget}, {len(prompts)} prompts x {len(methods)} methods, "
          f"{args.max_new_tokens} greedy tokens; pairs answering as the full cache:")
    print("| min_tokens | same as full | prompt lengths | differing |\n|---|---|---|---|")
    lengths = sorted(len(ids) for _, ids in prompts)
    for floor in floors:
        print(f"| {floor} | {matches[floor]}/{total} | {lengths[0]}-{lengths[-1]} | {', '.join(misses[floor][:6])}"
              f"{' ...' if len(misses[floor]) > 6 else ''} |")
    print(json.dumps({str(f): matches[f] for f in floors}))


if __name__ == "__main__":
    main()
