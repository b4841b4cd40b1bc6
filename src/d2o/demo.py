"""`make demo`: passkey retrieval on the embedded model: the full cache, the paper's D2O and the
library's (``d2o-plus``) at 20% and 50%."""

from __future__ import annotations

import random

from d2o.data import essays
from d2o.eval.tasks.passkey import make_passkey_prompt, passkey_score
from d2o.runtime.generation import generate
from d2o.models import load_model

RUNS = (("full", 1.0), ("d2o", 0.2), ("d2o-plus", 0.2), ("d2o", 0.5), ("d2o-plus", 0.5))


def run_demo(model_name: str = "smollm2", n_tokens: int = 1500, seed: int = 0) -> list[dict]:
    model, tokenizer = load_model(model_name)
    prompt = make_passkey_prompt(tokenizer, essays(), n_tokens, random.Random(seed))
    rows = []
    for method, budget in RUNS:
        result = generate(model, tokenizer, prompt.text, method, budget, max_new_tokens=8)
        answer = result.texts[0].strip()
        rows.append({
            "method": method,
            "budget": budget,
            "answer": answer,
            "correct": bool(passkey_score(answer, prompt.key)),
            "kv_tokens": result.report.kv_tokens_kept,
            "kv_bytes": result.report.kv_bytes,
            "seconds": result.seconds,
        })
    print(f"Passkey retrieval, {prompt.n_tokens}-token prompt (essays as filler), key {prompt.key} "
          f"at depth {prompt.depth:.0%}, model {model_name}\n")
    print(f"{'method':<8} {'budget':>6}  {'answer':<24} {'correct':<7} {'KV tokens':>9} {'KV MiB':>7} {'time s':>6}")
    for row in rows:
        print(f"{row['method']:<8} {row['budget']:>6.0%}  {row['answer'][:24]:<24} {str(row['correct']):<7} "
              f"{row['kv_tokens']:>9} {row['kv_bytes'] / 2**20:>7.2f} {row['seconds']:>6.1f}")
    return rows
