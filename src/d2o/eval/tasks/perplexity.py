"""Long-document language modelling under compression (StreamingLLM / PG-19 style)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from d2o.budget import Budget
from d2o.data import check_text_file, essays, read_text_file
from d2o.errors import D2OError
from d2o.eval.tasks.base import Sample, Task, register_task


@register_task
@dataclass
class Perplexity(Task):
    """The first ``length`` tokens of a real text (the essays, or ``text``: a file) fed ``chunk``
    tokens at a time through the compressed cache, each chunk attending to what the cache kept of
    everything before; the score is the perplexity of every token after the first. A ratio
    budget is a share of the whole text's KV cache (0.1 of 8192 tokens: 819 tokens per layer); a
    token budget (``256t``) is used as it is. The curve is the perplexity of each ``window``."""

    name = "perplexity"
    summary = "perplexity of a long real text fed in chunks through the compressed cache"
    metrics = ("perplexity",)
    higher_is_better = False
    asks = False

    length: int = 8192
    chunk: int = 64
    window: int = 512
    text: str | None = None

    def __post_init__(self):
        if self.chunk < 1 or self.length < 2 * self.chunk:
            raise D2OError(f"perplexity needs chunk >= 1 and length >= 2 chunks, got chunk {self.chunk}, "
                           f"length {self.length}")
        if self.window < 1:
            raise D2OError(f"perplexity's window (tokens per point of the curve) must be at least 1, got {self.window}")
        if self.text:
            check_text_file(self.text)

    def samples(self, tokenizer, limit, seed):
        return [Sample(f"perplexity-{self.length}", "", None, max_new_tokens=0, meta={"tokens": self.length})]

    def encode(self, sample, tokenizer, protocol: str = "prompt"):
        self.check_protocol(protocol)
        source = read_text_file(self.text) if self.text else essays()
        ids = tokenizer(source, add_special_tokens=False).input_ids
        if len(ids) < self.length:
            raise D2OError(f"the text has {len(ids)} tokens, fewer than length={self.length}")
        return ids[: self.length], []

    def run(self, runner, samples, ids, questions, todos):
        from d2o.eval.runner import Outcome  # here, not at import: checking options must not wait for torch

        sample, todo = samples[0], todos[0]  # one text, never a shared context (no question)
        for run in todo:
            start = time.perf_counter()
            cache = runner.cache(run.method, share_of(run.budget, self.length))
            perplexity, curve = self.evaluate(runner.model, ids, cache)
            yield sample, Outcome(run, None, {"perplexity": perplexity}, cache.report(), time.perf_counter() - start,
                                  None, extra={"curve": curve})

    def evaluate(self, model, ids: list[int], cache) -> tuple[float, list[float]]:
        """Perplexity of every token after the first through ``cache``, and per ``window``."""
        nll = token_nll(model, ids, cache, self.chunk).double()
        curve = [math.exp(part.mean().item()) for part in nll.split(self.window)]
        return math.exp(nll.mean().item()), curve

    def score(self, prediction, sample):
        raise D2OError("perplexity scores the text itself, not an answer")


def share_of(budget: Budget, length: int) -> Budget:
    """A ratio budget of a text fed in chunks as tokens per layer: that share of all ``length`` of
    its tokens (a ratio would be taken of the first chunk); a token budget as it is."""
    return Budget(tokens=max(1, round(budget.ratio * length))) if budget.ratio is not None else budget


def token_nll(model, ids: list[int], cache, chunk: int):
    """The negative log-likelihood of every token of ``ids`` after the first, fed ``chunk`` tokens
    at a time through ``cache``: each chunk attends to what the cache kept of everything before."""
    import torch

    device = next(model.parameters()).device
    tokens = torch.tensor([ids])
    losses, previous = [], None
    with torch.inference_mode():
        for start in range(0, tokens.shape[1], chunk):
            part = tokens[:, start : start + chunk].to(device)
            logits = model(input_ids=part, cache=cache).logits[0].float()
            predictors = logits[:-1] if previous is None else torch.cat([previous[None], logits[:-1]])
            targets = part[0] if previous is not None else part[0, 1:]
            losses.append(torch.nn.functional.cross_entropy(predictors, targets, reduction="none"))
            previous = logits[-1]
    return torch.cat(losses)
