"""How differently a method's scores and `heads=adaptive`'s counts fall across the KV heads of a layer.

On one passkey prompt of the embedded model, per method: the largest over the smallest KV head's
median score of a layer (the median over layers and the largest), from the scores the method gives
at the compression after the prefill (`heads=even`), and the share of a layer's pairs its fullest
head holds under `heads=adaptive` (median and largest over layers).

    .venv/bin/python benchmarks/head_scores.py --methods kvzip,expected-attention,snapkv --budget 0.5
"""

from __future__ import annotations

import argparse
import random
import statistics

import d2o
from d2o.data import essays
from d2o.eval.tasks.passkey import make_passkey_prompt
from d2o.runtime.generation import generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", default="kvzip,expected-attention,snapkv")
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--length", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    model, tokenizer = d2o.load_model("smollm2")
    prompt = make_passkey_prompt(tokenizer, essays(), args.length, random.Random(args.seed))
    print(f"{'method':20} {'score ratio, median':>20} {'max':>8} {'fullest head share, median':>27} {'max':>6}")
    for name in args.methods.split(","):
        method, ratios = d2o.get_method(name), []
        scored = method.score

        def watched(layer, scored=scored, ratios=ratios):
            scores = scored(layer)
            medians = scores[0].float().median(dim=-1).values
            ratios.append(float(medians.max() / medians.min().clamp_min(1e-12)))
            return scores

        object.__setattr__(method, "score", watched)  # this one object's scores, seen as the cache asks
        generate(model, tokenizer, prompt.text, method, args.budget, max_new_tokens=1)
        adaptive = generate(model, tokenizer, prompt.text, d2o.get_method(name, heads="adaptive"), args.budget,
                            max_new_tokens=1)
        shares = [max(layer.kept_per_head[0]) / sum(layer.kept_per_head[0]) for layer in adaptive.report.layers]
        print(f"{name:20} {statistics.median(ratios):20.1f} {max(ratios):8.1f} {statistics.median(shares):27.2f} "
              f"{max(shares):6.2f}")


if __name__ == "__main__":
    main()
