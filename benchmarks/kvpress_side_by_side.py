"""NVIDIA kvpress's KVzipPress and ExpectedAttentionPress on d2o's own evaluation prompts.

d2o's methods ``kvzip`` and ``expected-attention`` restate these two presses; this script runs the
originals (kvpress 0.5.5) on the very token ids d2o evaluates (passkey and NIAH, ``--protocol
context``: the context is compressed, the question fed after), so that both can be compared
prompt by prompt. Two steps, in two environments:

  export  (d2o's venv)     writes the prompts as token ids: the tasks and seeds of
                           docs/results/{passkey,niah}-context (passkey length=1500, 20 prompts;
                           niah lengths 500/1000/2000 x depths 0..1, one haystack; seed 0).
  run     (kvpress's venv) prefills each context under a press as kvpress's pipeline does
                           (``with press(model): model.model(input_ids=..., past_key_values=cache)``),
                           feeds the question at the positions after the context, decodes greedily,
                           and scores the answer as d2o does.

kvpress is installed only in a throwaway venv (it pins transformers<5.3; d2o needs a newer one):
it is never a d2o dependency, and ``run`` does not import d2o.

    /work/main/.venv/bin/python benchmarks/kvpress_side_by_side.py export prompts.jsonl
    VENV/bin/python benchmarks/kvpress_side_by_side.py run prompts.jsonl \\
        --presses kvzip,kvzip_whole,expected_attention --budgets 0.1,0.2,0.5 --out kvpress.jsonl \\
        [--compare docs/results/passkey-context/samples.jsonl docs/results/niah-context/samples.jsonl]
    python benchmarks/kvpress_side_by_side.py summary kvpress.jsonl --compare .../samples.jsonl

``kvzip_whole`` is KVzipPress told that the prompt has no chat-template opening (see ``run``);
``kvzip_even`` is that press with each layer's count shared evenly by its KV heads (``even_heads``).

Budget: the share of the context's KV kept (kvpress's compression_ratio = 1 - kept share); by
default with d2o's floor of 128 tokens per layer under ratio budgets (``--min-tokens``; 0: none).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import string
import sys
import time
from collections import defaultdict

MODEL = os.path.expanduser("~/.cache/d2o/models/smollm2")
TASKS = {  # the options, limit and seed of docs/results/{passkey,niah}-context
    "passkey": ({"length": 1500}, 20, 0),
    "niah": ({"lengths": (500, 1000, 2000), "depths": (0.0, 0.25, 0.5, 0.75, 1.0)}, 1, 0),
}


def export(args) -> None:
    """Write every prompt's context and question ids (d2o's ``Task.encode`` under "context")."""
    from transformers import AutoTokenizer

    from d2o.eval.tasks import get_task

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    with open(args.out, "w") as out:
        for name in args.tasks.split(","):
            options, limit, seed = TASKS[name]
            task = get_task(name, **options)
            for sample in task.samples(tokenizer, limit, seed):
                context_ids, question_ids = task.encode(sample, tokenizer, "context")
                out.write(json.dumps({"sample_id": sample.id, "task": name, "context_ids": context_ids,
                                      "question_ids": question_ids, "gold": sample.gold,
                                      "max_new_tokens": sample.max_new_tokens, "stop": list(sample.stop),
                                      "meta": sample.meta}) + "\n")
    print(f"wrote {args.out}")


# -- d2o's scores, restated (d2o.eval.tasks.passkey / niah, d2o.eval.metrics.normalize_answer) --------
def normalize_answer(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def score(task: str, prediction: str, gold: str) -> float:
    if task == "passkey":
        numbers = re.findall(r"\d+", prediction)
        return float(bool(numbers) and numbers[0] == gold)
    words, said = normalize_answer(gold).split(), set(normalize_answer(prediction).split())
    return sum(w in said for w in words) / len(words)


def stop_at(text: str, stops: list[str]) -> int | None:
    """Where the first stop string starts once the answer has begun (leading blanks are no answer)."""
    begun = len(text) - len(text.lstrip())
    found = [i for i in (text.find(s, begun) for s in stops if s) if i >= 0]
    return min(found) if found else None


def run(args) -> None:
    import logging

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    import kvpress

    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa").eval()
    model.config.name_or_path = args.model  # KVzipPress loads its tokenizer (and chat template) from here
    eos = model.generation_config.eos_token_id
    stop_ids = {i for i in ([eos] if isinstance(eos, int) else list(eos or []))
                + [tokenizer.eos_token_id, tokenizer.pad_token_id] if i is not None}
    # kvzip_whole: KVzipPress with its chat-template opening set to none (kvpress takes the first
    # prefix_length context tokens, 24 with SmolLM2's template, for that opening and never scores them;
    # d2o's prompts are raw, so those are the prompt's own first tokens, and d2o's kvzip scores them).
    presses = {"kvzip": kvpress.KVzipPress, "kvzip_whole": kvpress.KVzipPress,
               "kvzip_even": even_heads(kvpress.KVzipPress), "expected_attention": kvpress.ExpectedAttentionPress}
    prompts = [p for p in map(json.loads, open(args.prompts)) if p["task"] in args.tasks.split(",")]
    if args.limit:
        prompts = [p for task in dict.fromkeys(p["task"] for p in prompts)
                   for p in [q for q in prompts if q["task"] == task][: args.limit]]
    layers = model.model.layers

    def answer(p, press_name, budget):
        n = len(p["context_ids"])
        kept = max(budget * n, min(n, args.min_tokens))  # per layer, as d2o's ratio budget
        press = presses[press_name](compression_ratio=max(0.0, 1 - kept / n))
        cache, start = DynamicCache(), time.perf_counter()
        with torch.no_grad():
            with press(model):
                if press_name in ("kvzip_whole", "kvzip_even"):
                    press.prefix_length = 0  # set on entering; read once the context is prefilled
                model.model(input_ids=torch.tensor([p["context_ids"]]), past_key_values=cache)
            prefill = time.perf_counter() - start
            if press_name.startswith("kvzip"):  # kvpress masks the evicted keys (cache keeps its length)
                masks = [getattr(layer.self_attn, "masked_key_indices", None) for layer in layers]
                masked = sum(len(m[0]) for m in masks if m is not None)
                share = 1 - masked / (len(layers) * cache.layers[0].keys.shape[1] * n)
            else:
                share = sum(cache.layers[i].keys.shape[2] for i in range(len(layers))) / (len(layers) * n)
            ids, position, tokens = p["question_ids"], n, []
            for _ in range(p["max_new_tokens"]):
                out = model(input_ids=torch.tensor([ids]), past_key_values=cache, logits_to_keep=1,
                            position_ids=torch.arange(position, position + len(ids))[None])
                position += len(ids)
                token = int(out.logits[0, -1].argmax())
                if token in stop_ids:
                    break
                tokens.append(token)
                if stop_at(tokenizer.decode(tokens, skip_special_tokens=True), p["stop"]) is not None:
                    break
                ids = [token]
        for layer in layers:  # KVzip's masks must not outlive its cache
            layer.self_attn.masked_key_indices = None
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        cut = stop_at(text, p["stop"])
        prediction = (text if cut is None else text[:cut]).strip()
        return {"sample_id": p["sample_id"], "task": p["task"], "press": press_name, "budget": budget,
                "compression_ratio": round(press.compression_ratio, 6), "kv_kept_share": round(share, 4),
                "prediction": prediction, "gold": p["gold"], "score": score(p["task"], prediction, p["gold"]),
                "prefill_compress_seconds": round(prefill, 3), "seconds": round(time.perf_counter() - start, 3)}

    rows = []
    with open(args.out, "w") as out:
        for p in prompts:
            for press_name in args.presses.split(","):
                for budget in map(float, args.budgets.split(",")):
                    row = answer(p, press_name, budget)
                    logging.getLogger("kvpress").setLevel(logging.ERROR)  # KVzip's cost warning: once
                    rows.append(row)
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    print(f"{row['sample_id']:22} {press_name:18} {budget:<4g} score={row['score']:.2f} "
                          f"kept={row['kv_kept_share']:.3f} {row['seconds']:6.1f}s  {row['prediction']!r}",
                          flush=True)
    summary(rows, args.compare)


def even_heads(press_class):
    """``press_class`` (KVzipPress) with each layer's count of masked pairs, still chosen over every
    layer, shared evenly by the layer's KV heads, each masking its own lowest scores: the layout d2o's
    storage keeps (as many tokens in every KV head of a layer), so that the per-head counts of
    KVzipPress are the one difference left with ``kvzip_whole``."""

    class EvenHeads(press_class):
        def compress_post(self, model):
            import torch

            super().compress_post(model)
            if self.compression_ratio <= 0:
                return
            for layer in model.model.layers:
                module = layer.self_attn
                masked = getattr(module, "masked_key_indices", None)
                if masked is None:
                    continue
                scores = self.score_val[int(module.layer_idx)]  # (batch 1, kv heads, context)
                heads = scores.shape[1]
                counts = [len(masked[0]) // heads + (h < len(masked[0]) % heads) for h in range(heads)]
                seq = [torch.topk(-scores[0, h], counts[h]).indices.cpu() for h in range(heads)]
                head = [torch.full((counts[h],), h, dtype=torch.long) for h in range(heads)]
                seq_indices, head_indices = torch.cat(seq), torch.cat(head)
                module.masked_key_indices = (torch.zeros_like(seq_indices), head_indices, seq_indices)

    return EvenHeads


def summary(rows: list[dict], compare: list[str]) -> None:
    """Mean score per task, press and budget; with d2o's kvzip / expected-attention rows of the same
    samples alongside when ``--compare`` names d2o results (samples.jsonl)."""
    d2o = defaultdict(list)
    names = {"kvzip": ("kvzip", "kvzip_whole", "kvzip_even"), "expected-attention": ("expected_attention",)}
    ids = {r["sample_id"] for r in rows}
    for path in compare or []:
        for line in open(path):
            r = json.loads(line)
            if r["method"] in names and r["sample_id"] in ids:
                for press in names[r["method"]]:
                    d2o[(r["task"], press, float(r["budget"]))].append(r["score"])
    groups = defaultdict(list)
    for r in rows:
        groups[(r["task"], r["press"], r["budget"])].append(r["score"])
    print(f"\n{'task':8} {'press':18} {'budget':>6} {'n':>3} {'kvpress':>8} {'d2o':>6}")
    for key in sorted(groups):
        mean = sum(groups[key]) / len(groups[key])
        theirs = f"{sum(d2o[key]) / len(d2o[key]):6.3f}" if d2o.get(key) else "     -"
        print(f"{key[0]:8} {key[1]:18} {key[2]:6g} {len(groups[key]):3} {mean:8.3f} {theirs}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write the prompts' token ids (run with d2o's venv)")
    ex.add_argument("out")
    ex.add_argument("--tasks", default="passkey,niah")
    ex.add_argument("--model", default=MODEL)
    rn = sub.add_parser("run", help="answer them under kvpress's presses (run with kvpress's venv)")
    rn.add_argument("prompts")
    rn.add_argument("--tasks", default="passkey,niah")
    rn.add_argument("--presses", default="kvzip,expected_attention")
    rn.add_argument("--budgets", default="0.1,0.2,0.5")
    rn.add_argument("--min-tokens", type=int, default=128, help="d2o's per-layer floor under ratio budgets")
    rn.add_argument("--limit", type=int, default=0, help="the first N prompts of each task (0: all)")
    rn.add_argument("--compare", nargs="*", help="d2o samples.jsonl files to show d2o's means beside")
    rn.add_argument("--threads", type=int, default=1, help="torch's CPU threads")
    rn.add_argument("--out", required=True)
    rn.add_argument("--model", default=MODEL)
    sm = sub.add_parser("summary", help="the means of answers ``run`` wrote, beside d2o's on the same prompts")
    sm.add_argument("answers", nargs="+", help="files ``run`` wrote (--out)")
    sm.add_argument("--compare", nargs="*", help="d2o samples.jsonl files to show d2o's means beside")
    args = parser.parse_args(argv)
    if args.command == "export":
        export(args)
    elif args.command == "summary":
        summary([json.loads(line) for path in args.answers for line in open(path)], args.compare)
    else:
        run(args)


if __name__ == "__main__":
    sys.exit(main())
