"""d2o as a model of EleutherAI's lm-evaluation-harness: any ``lm_eval`` task on a compressed KV cache.

Importing this module registers the model ``d2o`` (``lm_eval.api.registry.register_model``, as
lm-eval's documentation describes for models of other packages); ``d2o lm-eval ARGS`` is
lm-eval's command line with it registered (``lm_eval`` itself imports only its own models):

    d2o lm-eval --model d2o --model_args pretrained=smollm2,method=d2o-plus,budget=0.2 --tasks ...

    import d2o.eval.harness, lm_eval
    lm_eval.simple_evaluate(model="d2o", model_args="method=d2o-plus,budget=0.2", tasks=[...])

- ``generate_until``: each context is prefilled and compressed as ``d2o generate`` compresses a
  prompt (rows of a batch left-padded into one cache), then decoded greedily until a stop string.
- ``loglikelihood``: the context is prefilled and compressed alone, then the continuation is fed
  after it in one pass: each continuation token is predicted from the compressed context. The
  continuations of one context share its compression (a copy of the cache each).
- ``loglikelihood_rolling``: the text fed ``chunk`` tokens at a time through a cache compressed to
  the budget's share of the text (as ``d2o eval --task perplexity``).

Token ids follow lm-eval's ``hf`` model: no special tokens added, except a start-of-sequence token
for Gemma (``add_bos_token``); a context's trailing blanks move to its continuation.
"""

from __future__ import annotations

from collections import defaultdict

import lm_eval.models  # noqa: F401  (lm-eval's own models first: it lists them only while its registry is empty)
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from d2o.budget import EVICT_EVERY, Budget
from d2o.engine.cache import CompressedCache
from d2o.errors import D2OError
from d2o.eval.tasks.perplexity import share_of, token_nll
from d2o.runtime.context import DEFAULT_METHOD, CompressedContext, compress_ids
from d2o.runtime.decoding import Batch, Sequence
from d2o.runtime.generation import resolve
from d2o.runtime.prompts import check_length, stop_token_ids


@register_model("d2o")
class D2OLM(LM):
    """``pretrained``: ``smollm2``, ``gemma3-270m`` or a local model folder; ``method`` and
    ``budget`` as ``d2o generate`` takes them; other arguments not named here are the method's
    options. ``chunk``: tokens per pass of ``loglikelihood_rolling``."""

    def __init__(self, pretrained: str = "smollm2", method: str = DEFAULT_METHOD, budget=0.2, batch_size=1,
                 dtype: str = "float32", attention: str = "sdpa", device: str | None = None,
                 min_tokens: int | None = None, evict_every: int = EVICT_EVERY, kv_bits: int | None = None,
                 add_bos_token: bool | None = None, chunk: int = 512, max_batch_size=None,  # (lm-eval passes it)
                 **method_options):
        super().__init__()
        from d2o.models import load_model

        if not str(batch_size).isdigit() or int(batch_size) < 1:
            raise D2OError(f"batch_size={batch_size!r} must be a whole number >= 1 (d2o does not size batches "
                           f"itself: 'auto' is not supported)")
        if not isinstance(chunk, int) or chunk < 1:
            raise D2OError(f"chunk={chunk!r} must be a whole number of tokens >= 1")
        self.method, self.budget = resolve(method, str(budget), min_tokens, **method_options)
        self.batch_size = int(batch_size)
        self.evict_every, self.kv_bits, self.chunk = evict_every, kv_bits, chunk
        self.model, self.tokenizer = load_model(pretrained, dtype=dtype, attention=attention,
                                                device=None if device in (None, "cpu") else device)
        model_type = getattr(self.model.config, "model_type", "")
        self.add_bos_token = ("gemma" in model_type) if add_bos_token is None else bool(add_bos_token)
        self.stop_ids = stop_token_ids(self.model, self.tokenizer)
        self.where = next(self.model.parameters()).device

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=self.add_bos_token).input_ids

    def prefix_token(self) -> int:
        """What an empty context is: the start-of-sequence token, else the end-of-sequence token (lm-eval's)."""
        token = self.tokenizer.bos_token_id if self.add_bos_token else None
        token = token if token is not None else self.tokenizer.eos_token_id
        if token is None:
            raise D2OError("an empty context is scored after the end-of-sequence token, and the tokenizer has none")
        return token

    def cache(self, budget: Budget | None = None) -> CompressedCache:
        return CompressedCache(self.model, self.method, budget or self.budget, tokenizer=self.tokenizer,
                               evict_every=self.evict_every, kv_bits=self.kv_bits)

    # -- generate_until ---------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        answers: list[str | None] = [None] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i].args[0]))  # similar lengths together
        for start in range(0, len(order), self.batch_size):
            rows = order[start:start + self.batch_size]
            by_settings = defaultdict(list)  # one batch decodes under one setting of length and stops
            for i in rows:
                until, max_new = self._generation_settings(requests[i].args[1])
                by_settings[(until, max_new)].append(i)
            for (until, max_new), indices in by_settings.items():
                prompts = [self.encode(requests[i].args[0]) or [self.prefix_token()] for i in indices]
                check_length(self.model, max(map(len, prompts)), max_new)
                sequences = [Sequence(self.tokenizer, max_new, stop_ids=self.stop_ids, stop_strings=until)
                             for _ in indices]
                Batch.prefill(self.model, self.cache(), prompts, sequences).run()
                for i, sequence in zip(indices, sequences):
                    answers[i] = sequence.text
                    self.cache_hook.add_partial("generate_until", requests[i].args, sequence.text)
        return answers

    def _generation_settings(self, kwargs: dict) -> tuple[tuple[str, ...], int]:
        """The stop strings and answer length of a request; only greedy decoding is offered."""
        kwargs = dict(kwargs or {})
        until = kwargs.pop("until", None) or ()
        until = (until,) if isinstance(until, str) else tuple(until)
        max_new = int(kwargs.pop("max_gen_toks", 256))
        if kwargs.pop("do_sample", False) or float(kwargs.pop("temperature", 0.0) or 0.0) > 0:
            raise D2OError("the d2o model decodes greedily: do_sample / temperature > 0 are not supported")
        return until, max_new

    # -- loglikelihood ----------------------------------------------------------------------------

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        by_context: dict[tuple[int, ...], list[tuple[int, list[int]]]] = defaultdict(list)
        for i, request in enumerate(requests):
            context, continuation = self._pair(*request.args)
            by_context[tuple(context)].append((i, continuation))
        for context, items in by_context.items():
            check_length(self.model, len(context) + max(len(c) for _, c in items))
            compressed = compress_ids(self.model, self.tokenizer, list(context), self.method, self.budget,
                                      evict_every=self.evict_every, kv_bits=self.kv_bits)
            for start in range(0, len(items), self.batch_size):
                chunk = items[start:start + self.batch_size]
                for (i, continuation), result in zip(chunk, self._score(compressed, [c for _, c in chunk])):
                    results[i] = result
                    self.cache_hook.add_partial("loglikelihood", requests[i].args, result)
        return results

    def _pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm-eval's ``_encode_pair``: the context's trailing blanks go to the continuation, whose
        ids are those the whole text has after the context's."""
        blanks = len(context) - len(context.rstrip())
        if blanks:
            context, continuation = context[:-blanks], context[-blanks:] + continuation
        if not context:
            return [self.prefix_token()], self.tokenizer(continuation, add_special_tokens=False).input_ids
        whole, cut = self.encode(context + continuation), len(self.encode(context))
        return whole[:cut], whole[cut:]

    def _score(self, compressed: CompressedContext, continuations: list[list[int]]) -> list[tuple[float, bool]]:
        """Each continuation fed after a copy of the compressed context (right-padded into one pass:
        a row's padding comes after its tokens, which cannot see it)."""
        longest = max(map(len, continuations))
        caches = [compressed.cache.copy() for _ in continuations]
        for other in caches[1:]:
            caches[0].join([other])
        ids = torch.tensor([c + [c[-1]] * (longest - len(c)) for c in continuations], device=self.where)
        positions = compressed.positions[0] + torch.arange(longest, device=self.where)
        with torch.inference_mode():
            logits = self.model(input_ids=ids[:, :-1], position_ids=positions[None, :-1].expand(len(ids), -1),
                                cache=caches[0]).logits if longest > 1 else None
        results = []
        for row, continuation in enumerate(continuations):
            predictors = compressed.logits[:1].float()
            if len(continuation) > 1:
                predictors = torch.cat([predictors, logits[row, :len(continuation) - 1].float()])
            logprobs = torch.log_softmax(predictors, dim=-1)
            targets = torch.tensor(continuation, device=self.where)
            total = logprobs.gather(-1, targets[:, None]).sum().item()
            results.append((total, bool((logprobs.argmax(-1) == targets).all())))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        results = []
        for request in requests:
            ids = [self.prefix_token()] + self.tokenizer(request.args[0], add_special_tokens=False).input_ids
            check_length(self.model, len(ids))
            total = -token_nll(self.model, ids, self.cache(share_of(self.budget, len(ids))), self.chunk).sum().item()
            results.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return results
