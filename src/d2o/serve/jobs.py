"""What the engine schedules: a request's ``Job`` (its row, its plan, its events) and a ``Lane``
(rows of one method and budget in one running batch, and what that batch can hold at most)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import torch

from d2o.runtime.decoding import Batch, Sequence
from d2o.runtime.memory import joined_widths, padded_bytes, prefix_widths


@dataclass
class Result:
    """A finished request: its text and what its cache held when it finished."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    kv_tokens: int
    kv_tokens_full: int
    kv_bytes: int
    kv_bytes_full: int
    cached_tokens: int = 0  # prompt tokens found compressed in the prefix cache


class Job:
    """One request: its prompt's token ids, its row's rules, its KV plan, and the queue through
    which its events ("started", "delta", "done", "error") reach the handler's event loop."""

    def __init__(self, ids, sequence, method, budget, kv_plan, stream: bool, loop):
        self.ids, self.sequence, self.method, self.budget, self.plan = ids, sequence, method, budget, kv_plan
        self.key = (method.name, str(budget) if not method.keeps_everything else "1")
        self.stream = stream
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.peaks: torch.Tensor | None = None  # (L,) its row's most slots per layer, once prefilled
        self.own: torch.Tensor | None = None  # (L,) of those, the most beside a shared prefix (``own_peaks``)
        self.sent = ""  # text streamed so far
        self.counted = 0  # tokens counted in the statistics so far
        self.boundary: int | None = None  # its earlier turns' length, where its prefix may be cached
        self.prefix = None  # the kept context (to its boundary) it will read in place, its plan counting on it
        self.cached_tokens = 0  # of its prompt, found compressed in the prefix cache
        self.prefilling = None  # its prefill in chunks under way (``Batch.prefill_steps``), between rounds
        self.partial = None  # that prefill's cache
        self.partial_bytes = 0  # what that cache held after its last chunk (the KV gauge counts it)
        self.prefilled = None  # its batch, prefilled on the prefill thread, until it joins a lane
        self.arrived = time.monotonic()
        self.turn = self.arrived  # when the prefill thread last fed it a chunk (or it arrived)
        self.last_token_at: float | None = None  # when its latest token was counted

    def drop_prefill(self) -> None:
        """Its prefill in chunks is over (done, cut short or failed): its cache goes with it."""
        self.prefilling = self.partial = None
        self.partial_bytes = 0

    def emit(self, kind: str, payload=None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop has closed: nobody is listening
            pass

    def result(self) -> Result:
        seq, report = self.sequence, self.sequence.report
        return Result(seq.text, seq.finish_reason, seq.prompt_tokens, len(seq.tokens), report.kv_tokens_kept,
                      report.kv_tokens_full, report.kv_bytes, report.kv_bytes_full, self.cached_tokens)


def stable_text(sequence: Sequence) -> str:
    """The answer so far, less what a later token could still change: an incomplete UTF-8
    character at its end, and an ending that could be the start of a stop string."""
    if sequence.finished:
        return sequence.text
    text = sequence.raw_text.rstrip("\ufffd")
    hold = max((k for stop in sequence.stop_strings for k in range(1, len(stop)) if text.endswith(stop[:k])),
               default=0)
    return text[:len(text) - hold]


class Lane:
    """Rows of one method and budget decoding together: one ``Batch`` and each row's job."""

    def __init__(self, batch: Batch, job: Job, per_slot: list[int], per_row: int = 0,
                 per_vector: list[int] | None = None):
        self.key, self.batch, self.per_slot, self.per_row = job.key, batch, per_slot, per_row
        self.per_vector = per_vector  # the keys' and values' part of per_slot: a shared prefix's held once
        self.jobs = {id(job.sequence): job}

    def rows(self) -> list[Job]:
        return [self.jobs[id(sequence)] for sequence in self.batch.sequences]

    def bound(self, newcomer: Batch | None = None, job: Job | None = None) -> int:
        """The most bytes this lane can hold (with ``newcomer``'s row joined, if given)."""
        jobs, caches = self.rows(), [self.batch.cache]
        if newcomer is not None:
            jobs.append(job)
            caches.append(newcomer.cache)
        if not jobs:
            return 0
        widths = joined_widths(caches, max(j.sequence.max_new_tokens - len(j.sequence.tokens) for j in jobs))
        return padded_bytes(widths, torch.stack([j.peaks for j in jobs]), self.per_slot, self.per_row,
                            prefix_widths(self.batch.cache), self.per_vector, torch.stack([j.own for j in jobs]))

    def accepts(self, batch: Batch) -> bool:
        """Whether ``batch``'s row may join this lane now: the same method and budget (equal, not
        merely printed alike) and the same stage of compression (``d2o-official`` compresses at
        its first decode step, so a row just prefilled cannot join a lane that has stepped)."""
        return self.batch.cache.why_not_joined(batch.cache) is None

    def join(self, batch: Batch, job: Job) -> None:
        self.batch.join(batch)
        self.jobs[id(job.sequence)] = job

    def drop_cancelled(self) -> list[Job]:
        """Drop the rows whose client has gone; returns their jobs. Each flag is read once: a
        handler may cancel a job at any moment, and the rows leaving the batch must be exactly
        the jobs leaving the lane (a job cancelled meanwhile leaves at the next round)."""
        rows = self.rows()
        gone = [job.cancelled for job in rows]
        if any(gone):
            self.batch.keep_rows([row for row, left in enumerate(gone) if not left])
            for job, left in zip(rows, gone):
                if left:
                    del self.jobs[id(job.sequence)]
        return [job for job, left in zip(rows, gone) if left]
