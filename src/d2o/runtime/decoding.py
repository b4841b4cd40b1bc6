"""One decoding path for every command: a prefill, then one token per row per step.

A ``Sequence`` is one row being generated: how it picks tokens (``Sampling``), when it ends (stop
tokens, stop strings, a length), what it has produced and how long that took. A ``Batch`` is rows
decoding together on one cache: ``step()`` picks every row's next token, lets finished rows leave
(their cache rows go with them) and feeds the others' tokens in one forward pass; ``join`` lets
new rows in between steps. ``generate``, the evaluation, the benchmarks, the demo and the server
all decode through it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from d2o.engine.api import QUESTION, ProbePass
from d2o.engine.probing import left_pad
from d2o.errors import D2OError
from d2o.options import whole


@dataclass(frozen=True)
class Sampling:
    """How a row picks its next token: greedy when ``temperature`` is 0, else sampling from the
    softmax at that temperature among the ``top_k`` likeliest tokens (0: all), then within the
    nucleus ``top_p`` of what is left, renormalised (transformers' order), from the row's own
    generator (``seed``), so a row draws the same tokens whatever batch it runs in."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0

    def __post_init__(self):
        if not self.temperature >= 0.0:
            raise D2OError(f"temperature={self.temperature!r} must be >= 0 (0: greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise D2OError(f"top_p={self.top_p!r} must be in (0, 1]")
        if not whole(self.top_k) or self.top_k < 0:
            raise D2OError(f"top_k={self.top_k!r} must be a whole number >= 0 (0: no limit)")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise D2OError(f"seed={self.seed} must fit in 64 bits")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution (vocab,) a sampled token is drawn from, given next-token ``logits``."""
        # Shifted by the maximum, the likeliest token's logit is 0 at any temperature: one too small
        # for float32 (1e-300 is 0 there) makes the others -inf, never NaN (greedy in the limit).
        logits = logits.float()
        shifted = (logits - logits.max()) / max(self.temperature, torch.finfo(torch.float32).tiny)
        probs = torch.softmax(shifted, dim=-1).cpu()
        if 0 < self.top_k < probs.shape[-1]:  # ties with the k-th stay, as in transformers
            probs = probs.masked_fill(probs < probs.topk(self.top_k).values[-1], 0.0)
            probs /= probs.sum()
        if self.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            outside = sorted_probs.cumsum(-1) - sorted_probs >= self.top_p
            outside[0] = False  # the likeliest always stays (a top_p below float32's smallest is 0 there)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs.masked_fill(outside, 0.0))
            probs /= probs.sum()
        return probs


class Sequence:
    """One row: its tokens so far and the rules that pick and stop them.

    Stop strings are not part of its ``text``; a stop token ends it and is not part of its
    ``tokens``. With ``stop_after_space`` (the evaluation's tasks, whose stop is a newline) a stop
    string ends the answer only once it has begun: leading white space is not an answer. Without
    it (the server, as the OpenAI API) a stop string anywhere ends it.
    """

    def __init__(self, tokenizer, max_new_tokens: int, sampling: Sampling = Sampling(),
                 stop_ids: frozenset[int] = frozenset(), stop_strings: tuple[str, ...] = (), prompt_tokens: int = 0,
                 stop_after_space: bool = True):
        if max_new_tokens < 1:
            raise D2OError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.stop_ids = stop_ids
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.prompt_tokens = prompt_tokens
        self.stop_after_space = stop_after_space
        self.tokens: list[int] = []
        self.finish_reason: str | None = None  # "stop" or "length" once finished
        self.prefill_seconds = 0.0
        self.decode_seconds = 0.0
        self.report = None  # what its cache row held when it finished (a d2o cache's report)
        self._generator = None
        if not sampling.greedy:
            self._generator = torch.Generator()
            self._generator.manual_seed(sampling.seed if sampling.seed is not None
                                        else int(torch.randint(0, 2**62, (1,)).item()))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def choose(self, logits: torch.Tensor) -> int:
        """The next token from the next-token ``logits`` (vocab,)."""
        if self._generator is None:
            return int(logits.argmax())
        return int(torch.multinomial(self.sampling.probabilities(logits), 1, generator=self._generator))

    def push(self, token: int) -> bool:
        """Record ``token``; True when the sequence is finished (then the token is not fed back)."""
        if token in self.stop_ids:
            self.finish_reason = "stop"
            return True
        self.tokens.append(token)
        if self.stop_strings and self._stop_at() is not None:
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.max_new_tokens:
            self.finish_reason = "length"
        return self.finished

    @property
    def raw_text(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    @property
    def text(self) -> str:
        """The answer: the decoded tokens up to the first stop string."""
        raw = self.raw_text
        cut = self._stop_at(raw)
        return raw if cut is None else raw[:cut]

    def _stop_at(self, raw: str | None = None) -> int | None:
        raw = self.raw_text if raw is None else raw
        begun = len(raw) - len(raw.lstrip()) if self.stop_after_space else 0
        found = [i for i in (raw.find(stop, begun) for stop in self.stop_strings) if i >= 0]
        return min(found) if found else None


class Batch:
    """Rows decoding together on one cache; ``logits`` (B, vocab) are each row's next-token logits.

    Works on a ``CompressedCache`` (rows of any length, left-padded) or, for unpadded rows, on a
    plain transformers cache (the stock baseline of the benchmarks).
    """

    def __init__(self, model, cache, sequences: list[Sequence], logits: torch.Tensor, positions: torch.Tensor):
        self.model = model
        self.cache = cache
        self.sequences = list(sequences)
        self.logits = logits
        self.positions = positions  # (B,) the position of each row's next token: its real tokens so far
        self.step_seconds: list[float] = []

    @classmethod
    def prefill(cls, model, cache, prompts: list[list[int]], sequences: list[Sequence], question: str | None = "tail",
                ) -> Batch:
        """Run the prompts' token ids, left-padded into one batch, through ``model`` into ``cache`` (a
        d2o cache with ``prefill_chunk`` takes them in chunks; ``question``: what it shows after each
        chunk to a method that scores with a question: "tail", each prompt's own last tokens; None,
        nothing; or a list of token ids asked after every prompt, at the position after it)."""
        for batch in cls.prefill_steps(model, cache, prompts, sequences, question):
            pass
        return batch

    @classmethod
    def prefill_steps(cls, model, cache, prompts: list[list[int]], sequences: list[Sequence],
                      question: str | None = "tail"):
        """``prefill`` one chunk at a time: yields None after each chunk but the last, then the batch.
        The prefill's seconds are its chunks' own, not the time between them."""
        device = next(model.parameters()).device
        input_ids, mask = left_pad(prompts)
        padded = not bool(mask.all())
        if padded and not hasattr(cache, "policy"):
            raise D2OError("a batch of prompts of different lengths needs a d2o CompressedCache")
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        inputs = dict(input_ids=input_ids.to(device), attention_mask=mask.to(device) if padded else None,
                      position_ids=positions.to(device), logits_to_keep=1)
        if hasattr(cache, "prefill_steps"):
            steps = cache.prefill_steps(model, **inputs, **question_pass(cache, prompts, question))
        else:
            steps = ((model(**inputs, cache=cache), True) for _ in range(1))
        seconds, done = 0.0, False
        while not done:
            start = time.perf_counter()
            with torch.inference_mode():  # per chunk: between chunks the caller's own mode holds
                output, done = next(steps)
            seconds += seconds_since(start, device)
            if not done:
                yield None
        logits = output.logits[:, -1]
        for sequence, length in zip(sequences, mask.sum(-1).tolist()):
            sequence.prefill_seconds = seconds
            sequence.prompt_tokens = length
        yield cls(model, cache, sequences, logits, mask.sum(-1).to(device))

    @property
    def size(self) -> int:
        return len(self.sequences)

    def step(self) -> list[Sequence]:
        """Every row's next token; finished rows leave; the others' tokens go through the model.
        Returns the sequences that finished in this step."""
        tokens, staying, finished = [], [], []
        for row, sequence in enumerate(self.sequences):
            token = sequence.choose(self.logits[row])
            if sequence.push(token):
                if hasattr(self.cache, "report"):
                    sequence.report = self.cache.report([row])
                finished.append(sequence)
            else:
                tokens.append(token)
                staying.append(row)
        if finished:
            self.keep_rows(staying)
        if self.sequences:
            device = self.logits.device
            start = time.perf_counter()
            with torch.inference_mode():
                self.logits = self.model(input_ids=torch.tensor(tokens, device=device)[:, None],
                                         position_ids=self.positions[:, None], cache=self.cache,
                                         logits_to_keep=1).logits[:, -1]
            seconds = seconds_since(start, device)
            self.positions = self.positions + 1
            self.step_seconds.append(seconds)
            for sequence in self.sequences:
                sequence.decode_seconds += seconds
        return finished

    def feed(self, tokens: list[list[int]]) -> None:
        """More input for every row before it generates (a question after its compressed context):
        one forward pass of equal-length token lists; the next-token logits follow the last token."""
        device = self.logits.device
        ids = torch.tensor(tokens, device=device)
        positions = self.positions[:, None] + torch.arange(ids.shape[1], device=device)
        with torch.inference_mode():
            self.logits = self.model(input_ids=ids, position_ids=positions, cache=self.cache,
                                     logits_to_keep=1).logits[:, -1]
        self.positions = self.positions + ids.shape[1]
        for sequence in self.sequences:
            sequence.prompt_tokens += ids.shape[1]

    def keep_rows(self, rows: list[int]) -> None:
        """Only ``rows`` stay (finished or cancelled rows leave, and free their cache rows)."""
        if rows == list(range(self.size)):
            return
        self.sequences = [self.sequences[row] for row in rows]
        if rows:
            index = torch.tensor(rows, device=self.logits.device)
            self.cache.batch_select_indices(index)
            self.logits, self.positions = self.logits[index], self.positions[index]

    def join(self, other: Batch) -> None:
        """The rows of ``other`` (prefilled on a cache of the same method and budget) join this batch."""
        self.cache.join([other.cache])
        self.sequences += other.sequences
        self.logits = torch.cat([self.logits, other.logits])
        self.positions = torch.cat([self.positions, other.positions])

    def run(self) -> list[Sequence]:
        """Step until every row has finished; returns the sequences in their original order."""
        order = list(self.sequences)
        while self.sequences:
            self.step()
        return order


def question_pass(cache, prompts: list[list[int]], question) -> dict:
    """``CompressedCache.prefill``'s question and where it stands, for ``Batch.prefill``'s ``question``."""
    tokens = cache.policy.question_tokens
    if question is None or not tokens:
        return {}
    if question == "tail":
        return {"question": ProbePass([row[-tokens:] for row in prompts], tag=QUESTION,
                                      positions=[len(row) - len(row[-tokens:]) for row in prompts]), "in_prompt": True}
    return {"question": ProbePass([list(question)] * len(prompts), tag=QUESTION,
                                  positions=[len(row) for row in prompts]), "in_prompt": False}


def seconds_since(start: float, device: torch.device) -> float:
    """Seconds since ``start`` (``time.perf_counter``), once the work queued on ``device`` is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
