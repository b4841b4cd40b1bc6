"""The serving engine: the model, the queue, admission by KV memory, and continuous batching.

One thread does all model work, in rounds: prefill the next admitted request into a cache of its
own (``Batch.prefill``; with ``prefill_chunk``, one chunk of it per round, so that a long prompt
holds the running requests up by a chunk at a time, not by its whole prefill), let it join a
running batch of its method and budget (a *lane*) once prefilled, then step every lane once. With
``prefill_thread`` a second thread does the prefills instead (prompts in chunks take turns, a chunk
each), beside the rounds, which only join the prefilled requests to lanes and step them; while
both run passes each takes half the cores. A
request's row leaves its batch when it finishes or is cancelled, and its cache rows go with it.
Requests of different methods or budgets never share a batch (their caches cannot); requests of the
same key may run in more than one lane, when joining would not fit. Requests on one kept document
(the prefix cache) read its compressed keys and values in place, beside tokens of their own
(``engine.shared``): they share a lane of their own, which holds the document once.

Admission: a request is admitted when everything already admitted, at most, plus this request's
prefill and its budgeted cache fit under the cap. A lane is reserved at ``padded_bytes``: its rows
share one tensor per layer as wide as the widest row, so a short row beside a long one costs the
long one's width. An admitted request not yet prefilled reserves its ``plan``'s held bytes, and
the one prefill running at a time its whole prompt (on the prefill thread: each prefill under way,
and the largest of those not started); a request whose earlier turns are kept is
planned as its own tokens beside them (``shared_plan``) and holds that context from then on. Each
compressed document counts once, whether kept, read by lanes or counted on by admitted requests
(``_prefix_bytes``). Requests that do not fit wait in a bounded
queue, first come first served (none overtakes the head, so a large request is not starved);
beyond the queue, HTTP 503. A head that fits only without the kept documents, with nothing admitted
or running, has them evicted (least recently used first), since nothing else would free memory. A
request that could not fit even alone is refused at once.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque

import torch

from d2o.budget import Budget
from d2o.engine.cache import CompressedCache
from d2o.errors import D2OError
from d2o.methods import get_method
from d2o.runtime.context import compress_ids, conversation_ids
from d2o.runtime.decoding import Batch, Sampling, Sequence
from d2o.runtime.generation import resolve
from d2o.runtime.memory import (KVPlan, over_cap, own_peaks, peak_slots, plan, prefix_identity, row_bytes,
                                shareable, shared_plan, shared_prefix, slot_bytes)
from d2o.runtime.prompts import check_length, encode, positions, stop_token_ids
from d2o.serve.config import ServeConfig
from d2o.serve.jobs import Job, Lane, stable_text
from d2o.serve.prefixes import MIN_PREFIX_TOKENS, PrefixCache
from d2o.serve.protocol import APIError, Generation
from d2o.serve.stats import Stats

RETRY_AFTER = 1  # seconds a client told to retry waits


class Engine:
    """Owns the model and runs every request through it on one background thread."""

    def __init__(self, model, tokenizer, config: ServeConfig = ServeConfig()):
        method, budget = config.check()
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.name = config.model
        self.fingerprint = "d2o-" + uuid.uuid4().hex[:12]  # tells replicas apart
        self.cap = config.kv_memory
        self.stops = stop_token_ids(model, tokenizer)
        self.dtype_bytes = next(model.parameters()).element_size()
        self.evict_every, self.kv_bits = config.evict_every, config.kv_bits
        self.prefill_chunk = config.prefill_chunk
        smallest = self._plan(method, budget, 1, 1).peak_bytes
        if smallest > self.cap:  # every request would be refused
            raise D2OError(f"--kv-memory of {self.cap:,} bytes holds not one request (a 1-token prompt and 1 new "
                           f"token need {smallest:,} bytes under {config.method})")
        self.stats = Stats()
        self.prefixes = PrefixCache(config.prefix_cache_memory) if config.prefix_cache_memory else None
        self._methods: dict[tuple, tuple] = {}  # key -> (method, budget), for /metrics
        self._lock = threading.Condition()
        self._waiting: deque[Job] = deque()  # not admitted yet
        self._admitted: deque[Job] = deque()  # admitted, to prefill (the head may be prefilling)
        self._lanes: list[Lane] = []
        self._bounds: dict[int, int] = {}  # id(lane) -> its reserved bytes
        self._closing = False
        # With prefill_thread: prompts are prefilled on a thread of their own, their batches handed to
        # the rounds here to join a lane (``_ready``), and while both run each takes half the cores.
        self._ready: list[Job] = []  # prefilled there (each its batch in ``prefilled``), to join a lane
        self._lane_bytes = 0  # what the lanes held when the rounds last looked (``_record_kv``)
        self._prefilling: Job | None = None  # the job the prefill thread is prefilling
        self._cores = torch.get_num_threads()
        self._threads = [threading.Thread(target=self._run, name="d2o-engine", daemon=True)]
        self._hooks = []
        if config.prefill_thread:
            prefills = threading.Thread(target=self._run_prefills, name="d2o-prefill", daemon=True)
            self._threads.append(prefills)

            def share_cores(module, args):  # a prefill takes every core again once nothing decodes beside it
                if threading.current_thread() is prefills:
                    torch.set_num_threads(self._share(bool(self._lanes)))

            self._hooks = [layer.register_forward_pre_hook(share_cores)
                           for layer in getattr(model.get_decoder(), "layers", ())]
        for thread in self._threads:
            thread.start()

    @classmethod
    def load(cls, config: ServeConfig) -> Engine:
        """Load ``config.model`` (quietly) and start an engine on it."""
        from transformers.utils import logging

        from d2o.models import load_model

        config.check()
        logging.disable_progress_bar()
        model, tokenizer = load_model(config.model, dtype=config.dtype, attention=config.attention,
                                      device_map=config.device_map)
        return cls(model, tokenizer, config)

    # -- the handlers' side (the event loop's thread) ---------------------------------------------
    def prepare(self, request: Generation, prompt, chat: bool, max_tokens: int | None, loop) -> Job:
        """Check a request and turn it into a job; bad input raises an ``APIError`` (HTTP 400)."""
        if request.model not in (None, self.name):
            raise APIError(404, f"the model {request.model!r} does not exist; this server runs {self.name!r}",
                           "model", "model_not_found")
        method, budget = self._resolve(request)
        try:
            ids = encode(self.tokenizer, [prompt], chat)[0]
        except D2OError as error:
            raise APIError(400, str(error), "messages" if chat else "prompt") from None
        limit = positions(self.model)
        if max_tokens is None:  # the default never makes a prompt that fits too long: it takes what is left
            max_tokens = self.config.max_tokens if limit is None else max(1, min(self.config.max_tokens,
                                                                                 limit - len(ids)))
        try:
            check_length(self.model, len(ids), max_tokens)
        except D2OError as error:
            prompt_fits = limit is None or len(ids) < limit
            param = "max_tokens" if prompt_fits else "messages" if chat else "prompt"  # the part to shorten
            raise APIError(400, str(error), param, "context_length_exceeded") from None
        kv_plan = self._plan(method, budget, len(ids), max_tokens)
        over = over_cap(kv_plan, self.cap, self.prefill_chunk is not None and self.prefill_chunk < len(ids))
        if over is not None:
            remedy = dict(prefill="a shorter prompt, or a server prefilling in chunks (d2o serve --prefill-chunk: "
                                  "a prefill whole holds every prompt token before the cache is compressed)",
                          held="a smaller kv_budget, prompt or max_tokens")[over]
            raise APIError(400, f"this request needs {kv_plan.peak_bytes:,} bytes of KV cache at its peak "
                           f"({method.name}, {len(ids)} prompt tokens + {max_tokens} new): more than the server's "
                           f"whole --kv-memory of {self.cap:,}; use {remedy}", None, "kv_memory_exceeded")
        sampling = Sampling(request.temperature, request.top_p, request.seed, max(request.top_k, 0))
        sequence = Sequence(self.tokenizer, max_tokens, sampling, self.stops, tuple(request.stop or ()),
                            stop_after_space=False)  # OpenAI: a stop string anywhere ends the answer
        job = Job(ids, sequence, method, budget, kv_plan, request.stream, loop)
        if self.prefixes is not None and chat and method.compress_after_forward == 1:
            job.boundary = self._boundary(prompt, ids)
        return job

    def _plan(self, method, budget, prompt_tokens: int, new_tokens: int):
        """The KV bytes of one request here (``runtime.memory.plan``), prefilled as this server does:
        in chunks, if it does, with a method that scores with the question shown it after each."""
        return plan(self.model.config, method, budget, prompt_tokens, new_tokens, self.dtype_bytes,
                    evict_every=self.evict_every, kv_bits=self.kv_bits, prefill_chunk=self.prefill_chunk,
                    question=bool(method.question_tokens))

    def _boundary(self, messages: list[dict], ids: list[int]) -> int | None:
        """Where the turns before a chat's last user message end in ``ids`` (None: it does not end
        in a user message after others, the turns are too short to keep, or the template writes
        them differently once the message follows)."""
        if len(messages) < 2 or messages[-1].get("role") != "user":
            return None
        try:
            before = conversation_ids(self.tokenizer, messages[:-1])
        except D2OError:
            return None
        if len(before) < MIN_PREFIX_TOKENS or len(before) >= len(ids) or ids[: len(before)] != before:
            return None
        return len(before)

    def _resolve(self, request: Generation):
        try:
            name = request.kv_method or self.config.method
            method = get_method(name, **self.config.method_options.get(name, {}))
        except D2OError as error:
            raise APIError(400, str(error), "kv_method") from None
        try:
            budget = request.kv_budget if request.kv_budget is not None else self.config.budget
            method, budget = resolve(method, Budget.parse(budget, self.config.min_tokens))
        except D2OError as error:
            raise APIError(400, str(error), "kv_budget") from None
        return method, Budget.parse(1.0) if method.keeps_everything else budget

    def submit(self, job: Job) -> None:
        """Admit ``job`` now, queue it, or refuse it with HTTP 503 when the queue is full."""
        with self._lock:
            if self._closing:
                raise APIError(503, "the server is shutting down", None, "shutting_down", "server_error")
            self._promote()  # clients that gave up while waiting leave their places
            if not self._waiting:
                self._pin(job)
            if not self._waiting and self._reserved([*self._admitted, job]) <= self.cap:
                self._admit(job)
            elif len(self._waiting) < self.config.max_queue:
                self._waiting.append(job)
                self.stats.waiting_peak = max(self.stats.waiting_peak, len(self._waiting))
            else:
                self.stats.requests[(*job.key, "rejected")] += 1
                raise APIError(503, f"the server is at its KV memory cap ({self.cap:,} bytes) and its queue is "
                               f"full ({self.config.max_queue} waiting); retry later", None, "overloaded",
                               "server_error", {"Retry-After": str(RETRY_AFTER)})
            self._lock.notify_all()

    def cancel(self, job: Job) -> None:
        """The client has gone: its row leaves its batch (or it leaves the queue) at the next round."""
        with self._lock:
            job.cancelled = True
            self._lock.notify_all()

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        for thread in self._threads:
            thread.join(timeout=30)
        for hook in self._hooks:
            hook.remove()

    # -- admission (under the lock) ----------------------------------------------------------------
    def _reserved(self, admitted, starting: Job | None = None) -> int:
        """Bytes reserved for the lanes and the ``admitted`` jobs: each job's plan's held bytes, and
        beyond them its prefill's while it runs. The rounds prefill one job at a time: the largest such
        extra. The prefill thread interleaves prompts fed in chunks: each extra of a prefill under way,
        and the largest of the others' (the next to start); ``starting``: whether that job may start
        now, beside those under way."""
        held = sum(job.plan.held_bytes for job in admitted)
        extra = {job: max(job.plan.prefill_bytes - job.plan.held_bytes, 0) for job in admitted}
        if not self.config.prefill_thread:
            prefill = max(extra.values(), default=0)
        else:
            under_way = [job for job in admitted if job.prefilling is not None or job is starting]
            waiting = [extra[job] for job in admitted if job not in under_way] if starting is None else []
            prefill = sum(extra[job] for job in under_way) + max(waiting, default=0)
        return sum(self._bounds.values()) + held + prefill + self._prefix_bytes(admitted)

    def _prefix_bytes(self, admitted=()) -> int:
        """Bytes of the compressed documents held, each once: kept by the prefix cache (whole), read in
        place by lanes (their keys and values), or counted on by ``admitted`` requests' plans."""
        held = {} if self.prefixes is None else {prefix_identity(c.cache): c.nbytes for c in self.prefixes.contexts()}
        for job in admitted:
            if job.prefix is not None:
                held.setdefault(prefix_identity(job.prefix.cache), job.prefix.nbytes)
        for lane in self._lanes:
            shared = shared_prefix(lane.batch.cache) if lane.batch.sequences else None
            if shared is not None:
                held.setdefault(*shared)
        return sum(held.values())

    @staticmethod
    def _prefix_key(job: Job) -> tuple:
        return job.key, job.budget.min_tokens, repr(job.method)

    def _shared_plan(self, job: Job, context) -> KVPlan:
        """The job's KV bytes as its own tokens beside ``context``'s keys and values (read in place)."""
        return shared_plan(context.cache, len(job.ids) - len(context.ids), job.sequence.max_new_tokens,
                           slot_bytes(self.model.config, self.dtype_bytes, job.method, allocated=True),
                           slot_bytes(self.model.config, self.dtype_bytes, job.method, stock=True))

    def _pin(self, job: Job) -> None:
        """Plan a request whose earlier turns are kept (to its boundary) as its own tokens beside them,
        which it will read in place: it holds that context from now on, whatever the prefix cache
        evicts. A request already pinned, being prefilled, or without such a prefix, is left as it is."""
        if job.prefix is not None or job.prefilling is not None or job.boundary is None or self.prefixes is None \
                or not self.config.share_prefixes:
            return
        found = self.prefixes.longest(self._prefix_key(job), job.ids, job.boundary)
        if found is not None and len(found.ids) == job.boundary and shareable(found.cache):
            job.prefix, job.plan = found, self._shared_plan(job, found)

    def _admit(self, job: Job) -> None:
        self._admitted.append(job)
        self._lock.notify_all()  # the prefill thread, if there is one, takes it
        self._methods.setdefault(job.key, (job.method, job.budget))
        self.stats.admitted(job.key, len(job.ids), job.sequence.max_new_tokens)

    def _promote(self) -> None:
        """Drop the cancelled waiting requests (wherever they wait: each holds a place in the
        queue), then admit the others, first come first served, while they fit."""
        for gone in [job for job in self._waiting if job.cancelled]:
            self._waiting.remove(gone)
            self.stats.requests[(*gone.key, "cancelled")] += 1
        for job in self._admitted:  # those admitted before their document was kept
            self._pin(job)
        while self._waiting:
            head = self._waiting[0]
            self._pin(head)
            if self._reserved([*self._admitted, head]) > self.cap:
                # With nothing admitted or running, only the kept documents hold memory, and nothing
                # else will free any: the least recently used go (not the one the head reads).
                idle = not (self._admitted or self._lanes) and self.prefixes is not None
                if not idle or self.prefixes.evict_oldest(head.prefix) is None:
                    break
                continue
            self._admit(self._waiting.popleft())

    # -- the engine's thread ------------------------------------------------------------------------
    def _run(self) -> None:
        """The rounds: the batches prefilled since join lanes (or, without a prefill thread, the next
        chunk of a prefill runs here), then every lane steps once."""
        apart = self.config.prefill_thread
        while True:
            with self._lock:
                self._promote()
                while not (self._closing or self._lanes or self._ready or (self._admitted and not apart)):
                    self._lock.wait()
                    self._promote()
                if self._closing:
                    break
                job = self._admitted[0] if self._admitted and not apart else None
                ready = list(self._ready)
                sharing = self._prefilling is not None
            try:
                for done in ready:
                    # Counted here, where no lane is mid-step: the prefill held at most its plan's
                    # prefill bytes beside the lanes, which the peak counts.
                    self._record_kv(transient=done.plan.prefill_bytes - _own_bytes(done.prefilled.cache))
                    self._place(done, done.prefilled)
                if job is not None:
                    self._prefill(job)
                torch.set_num_threads(self._share(sharing))
                for lane in list(self._lanes):
                    self._step(lane)
            except Exception as error:  # noqa: BLE001 - a bug: fail what is in flight, keep serving
                self._fail_all(error)
        for job in [*self._waiting, *self._admitted, *(j for lane in self._lanes for j in lane.rows())]:
            job.emit("error", APIError(503, "the server is shutting down", None, "shutting_down", "server_error"))

    def _share(self, sharing: bool) -> int:
        """The threads a pass takes: every core, or half of them while the other thread runs passes too
        (so that the two threads' passes do not contend for the same cores)."""
        return max(1, self._cores // 2) if sharing else self._cores

    def _run_prefills(self) -> None:
        """The prefill thread: the admitted requests' prompts beside the rounds, a chunk at a time in
        turns (``_next_prefill``); each batch then goes to the rounds to join a lane (``_ready``)."""
        while True:
            with self._lock:
                while not self._closing and (job := self._next_prefill()) is None:
                    self._lock.wait()
                if self._closing:
                    break
                self._prefilling = job
            batch = None
            try:
                batch = self._prefill_next(job)
            except Exception as error:  # noqa: BLE001 - the server keeps serving the others
                job.drop_prefill()
                self._settle(job, APIError(500, f"prefill failed: {error!r}", kind="server_error"), "failed")
            with self._lock:
                self._prefilling, job.turn = None, time.monotonic()
                if batch is not None and job in self._admitted:  # (not failed meanwhile by ``_fail_all``)
                    job.prefilled = batch
                    self._ready.append(job)
                self._record_kv()  # its cache between chunks, or as prefilled, or gone with it
                self._lock.notify_all()

    def _next_prefill(self) -> Job | None:
        """The admitted job whose chunk comes next on the prefill thread (under the lock): of those under
        way, and those not started whose prefill fits beside them, the one fed longest ago (or admitted,
        if none is fed yet), so that a short prompt waits for one chunk of a long one, not for all."""
        waiting = [job for job in self._admitted if job.prefilled is None]
        fits = [job for job in waiting if job.prefilling is not None
                or self._reserved(self._admitted, starting=job) <= self.cap]
        return min(fits, key=lambda job: job.turn, default=None)

    def _prefill(self, job: Job) -> None:
        """The next chunk of the job's prefill (all of it, unless the server prefills in chunks), in a
        round; once its prompt is in, the job joins a lane."""
        batch = self._prefill_next(job)
        if batch is not None:
            # Held now: the job's cache beside the lanes (its prefix counted once); its prefill held at
            # most its plan's prefill bytes, which the peak counts.
            own = _own_bytes(batch.cache)
            self._record_kv(extra=own, transient=job.plan.prefill_bytes - own)
            self._place(job, batch)

    def _prefill_next(self, job: Job) -> Batch | None:
        """The next chunk of the job's prefill (all of it, unless the server prefills in chunks): its
        batch once its prompt is in; None while chunks are to come, or when the job has left
        (cancelled, or failed with its error)."""
        if job.cancelled:
            job.drop_prefill()  # a prefill cut short: its cache goes at once
            return self._settle(job, None, "cancelled")
        try:
            batch = None
            if job.prefilling is None:
                batch = self._from_prefix(job) if self.prefixes is not None else None
                if batch is None:
                    cache = CompressedCache(self.model, job.method, job.budget, evict_every=self.evict_every,
                                            kv_bits=self.kv_bits, prefill_chunk=self.prefill_chunk)
                    job.prefilling = Batch.prefill_steps(self.model, cache, [job.ids], [job.sequence])
                    job.partial = cache
            if batch is None:
                batch = next(job.prefilling)
                if batch is None:  # more chunks to come: what its cache holds between them counts as held
                    job.partial_bytes = _own_bytes(job.partial)
                    return
                job.drop_prefill()
            peaks = peak_slots(batch.cache, job.sequence.max_new_tokens)
            job.peaks, job.own = peaks[0], own_peaks(batch.cache, job.sequence.max_new_tokens, peaks)[0]
        except D2OError as error:  # e.g. a ratio too small for a short prompt without a floor
            job.drop_prefill()
            return self._settle(job, APIError(400, str(error), "kv_budget"), "failed")
        except Exception as error:  # noqa: BLE001 - the server keeps serving the others
            job.drop_prefill()
            return self._settle(job, APIError(500, f"prefill failed: {error}", kind="server_error"), "failed")
        return batch

    def _place(self, job: Job, batch: Batch) -> None:
        """The prefilled job joins a lane it fits beside, or starts one."""
        # Every row of a lane is past its prompt's allocation.
        per_slot = slot_bytes(self.model.config, self.dtype_bytes, job.method, kv_bits=self.kv_bits, allocated=True)
        per_row = row_bytes(self.model.config, self.dtype_bytes, job.method, self.kv_bits)
        per_vector = slot_bytes(self.model.config, self.dtype_bytes, job.method, stock=True)
        with self._lock:  # the job stays admitted until it is placed (a failure below fails it too)
            base = self._reserved([other for other in self._admitted if other is not job])
            options = [(lane.bound(batch, job) - self._bounds[id(lane)], lane)
                       for lane in self._lanes if lane.accepts(batch)]
            options = [(grown, lane) for grown, lane in options if base + grown <= self.cap]
            if options:
                lane = min(options, key=lambda option: option[0])[1]
                lane.join(batch, job)
            else:  # alone it fits: its reservation covered its plan, which bounds its peak
                lane = Lane(batch, job, per_slot, per_row, per_vector)
                self._lanes.append(lane)
            self._bounds[id(lane)] = lane.bound()
            self._admitted.remove(job)
            self._ready = [other for other in self._ready if other is not job]
            running = sum(len(other.jobs) for other in self._lanes if other.key == job.key)
            self.stats.running_peak[job.key] = max(self.stats.running_peak[job.key], running)
        self._record_kv()
        job.emit("started")

    def _from_prefix(self, job: Job) -> Batch | None:
        """The job's batch from the prefix cache: the longest kept prefix of its tokens, extended to
        its boundary (and kept there) if it has more turns, or its turns compressed and kept there
        if none is; then the rest of its prompt fed. None when it has no prefix to reuse or keep."""
        key = self._prefix_key(job)
        limit = job.boundary if job.boundary is not None else len(job.ids) - 1
        with self._lock:
            found = job.prefix or self.prefixes.longest(key, job.ids, limit)
        context = found
        if job.boundary is not None and (found is None or len(found.ids) < job.boundary):
            context = (compress_ids(self.model, self.tokenizer, job.ids[: job.boundary], job.method, job.budget,
                                    evict_every=self.evict_every, kv_bits=self.kv_bits,
                                    prefill_chunk=self.prefill_chunk)
                       if found is None else found.extend_ids(job.ids[len(found.ids): job.boundary]))
            with self._lock:
                if not (self.config.share_prefixes and shareable(context.cache)):  # its copy comes beside it
                    self.prefixes.add(key, context, self.cap - self._reserved(self._admitted))
                else:  # kept, the job reads it in place from then on: its own plan is its part beside it
                    shared = self._shared_plan(job, context)
                    others = [other for other in self._admitted if other is not job]
                    if self.prefixes.add(key, context, self.cap - self._reserved(others) - shared.held_bytes):
                        job.prefix, job.plan = context, shared
        with self._lock:
            if found is None:
                self.prefixes.misses += 1
            else:
                self.prefixes.hits += 1
                self.prefixes.cached_tokens += len(found.ids)
        if context is None:
            return None
        job.cached_tokens = 0 if found is None else len(found.ids)
        return context.answer_batch([job.ids[len(context.ids):]], [job.sequence], self.config.share_prefixes)

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            jobs = [*self._admitted, *(job for lane in self._lanes for job in lane.jobs.values())]
            self._admitted.clear()
            self._ready.clear()
            self._lanes.clear()
            self._bounds.clear()
        for job in jobs:
            job.drop_prefill()
            self._settle(job, APIError(500, f"internal error: {error!r}", kind="server_error"), "failed")
        self._record_kv()

    def _step(self, lane: Lane) -> None:
        for job in lane.drop_cancelled():
            self._settle(job, None, "cancelled")
        if lane.batch.sequences:
            try:
                finished = lane.batch.step()
            except Exception as error:  # noqa: BLE001
                # Every job of the lane, those whose row finished in this step before its forward
                # pass failed included: they left the batch with their whole answer.
                for job in list(lane.jobs.values()):
                    if job.sequence.finished:
                        self._settle(job, None, "finished")
                    else:
                        self._settle(job, APIError(500, f"decoding failed: {error}", kind="server_error"), "failed")
                lane.jobs.clear()
                lane.batch.keep_rows([])  # the lane is dropped below, its cache with it
                finished = []
            for sequence in finished:
                self._settle(lane.jobs.pop(id(sequence)), None, "finished")
            new_tokens = 0
            for job in lane.rows():
                new_tokens += self._count(job)
                if job.stream:
                    self._stream(job)
            with self._lock:
                self.stats.generated(new_tokens)
        with self._lock:
            if lane.batch.sequences:
                self._bounds[id(lane)] = lane.bound()
            else:
                self._lanes.remove(lane)
                del self._bounds[id(lane)]
            self._promote()
        self._record_kv()

    def _stream(self, job: Job) -> None:
        text = stable_text(job.sequence)
        if len(text) > len(job.sent) and text.startswith(job.sent):
            job.emit("delta", text[len(job.sent):])
            job.sent = text

    def _count(self, job: Job) -> int:
        """The job's tokens made since it was last counted, timed into its histograms."""
        new = len(job.sequence.tokens) - job.counted
        if new:
            now = time.monotonic()
            self.stats.tokens_made(job.key, job.arrived, job.last_token_at, new, now)
            job.counted, job.last_token_at = job.counted + new, now
        return new

    def _settle(self, job: Job, error: APIError | None, outcome: str) -> None:
        """A job leaves: finished (its result), failed (its error) or cancelled (nobody listens)."""
        with self._lock:
            if job in self._admitted:
                self._admitted.remove(job)
            self.stats.requests[(*job.key, outcome)] += 1
            if outcome == "finished":
                self.stats.generated(self._count(job))
                self.stats.finished(job.key, job.arrived, time.monotonic())
        if error is not None:
            job.emit("error", error)
        elif outcome == "finished":
            result = job.result()
            if job.stream and result.text.startswith(job.sent) and len(result.text) > len(job.sent):
                job.emit("delta", result.text[len(job.sent):])
            job.emit("done", result)

    def _record_kv(self, extra: int = 0, transient: int = 0) -> None:
        """The KV gauge: the lanes' bytes and the prefilled batches' waiting to join one, ``extra`` (a
        cache not in either yet) and the prefixes once; ``transient``: bytes held beside those a moment
        ago (a prefill's, beyond what its cache holds now), for the peak."""
        with self._lock:
            if threading.current_thread() is self._threads[0]:  # the rounds: no lane is mid-step now
                self._lane_bytes = sum(_own_bytes(lane.batch.cache) for lane in self._lanes if lane.batch.sequences)
            # (a prefill in chunks under way, as its cache was after its last chunk; the prefixes of
            # admitted jobs too: each holds its context)
            held = self._lane_bytes + sum(_own_bytes(job.prefilled.cache) for job in self._ready) + extra + \
                sum(job.partial_bytes for job in self._admitted) + self._prefix_bytes(self._admitted)
            self.stats.kv(held, held + transient)

    # -- /metrics -------------------------------------------------------------------------------------
    def metrics(self) -> dict:
        with self._lock:
            stats = self.stats
            running = {}
            for lane in self._lanes:
                running[labels(lane.key)] = running.get(labels(lane.key), 0) + len(lane.jobs)
            values = {
                "requests_total": {(*labels(key[:2]), ("outcome", key[2])): n for key, n in stats.requests.items()},
                "requests_running": running,
                "requests_running_peak": {labels(key): n for key, n in stats.running_peak.items()},
                "requests_waiting": len(self._waiting),
                "requests_waiting_peak": stats.waiting_peak,
                "queue_capacity": self.config.max_queue,
                "prompt_tokens_total": stats.prompt_tokens,
                "generated_tokens_total": stats.generated_tokens,
                "generated_tokens_per_second": round(stats.tokens_per_second(), 3),
                "kv_bytes": stats.kv_bytes,
                "kv_bytes_peak": stats.kv_bytes_peak,
                "kv_bytes_reserved": self._reserved(self._admitted),
                "kv_bytes_cap": self.cap,
                "prefix_cache_bytes": 0 if self.prefixes is None else self.prefixes.nbytes,
                "prefix_cache_entries": 0 if self.prefixes is None else len(self.prefixes),
                "prefix_cache_hits_total": 0 if self.prefixes is None else self.prefixes.hits,
                "prefix_cache_misses_total": 0 if self.prefixes is None else self.prefixes.misses,
                "prefix_cache_evictions_total": 0 if self.prefixes is None else self.prefixes.evictions,
                "prompt_tokens_cached_total": 0 if self.prefixes is None else self.prefixes.cached_tokens,
            }
            shapes = dict(stats.shapes)
        values["kv_fit_requests"], values["kv_fit_requests_full"] = self._fits(shapes)
        return values

    def _fits(self, shapes: dict) -> tuple[dict, dict]:
        """For each method and budget served, how many requests of its mean shape fit at once under
        the cap, with it and with the full cache."""
        mine, full = {}, {}
        for key, (count, prompt_tokens, max_tokens) in shapes.items():
            method, budget = self._methods[key]
            shape = (max(1, round(prompt_tokens / count)), max(1, round(max_tokens / count)), self.dtype_bytes)
            mine[labels(key)] = fit(self.cap, self._plan(method, budget, *shape[:2]))
            full[labels(key)] = fit(self.cap, plan(self.model.config, get_method("full"), Budget.parse(1.0), *shape))
        return mine, full


def _own_bytes(cache) -> int:
    """The bytes ``cache`` holds but a prefix it reads in place (counted once, ``_prefix_bytes``)."""
    return cache.nbytes - (shared_prefix(cache) or (0, 0))[1]


def labels(key: tuple) -> tuple:
    return (("budget", key[1]), ("method", key[0]))


def fit(cap: int, kv_plan) -> int:
    """How many requests of ``kv_plan`` fit at once under ``cap``, prefilled one at a time."""
    return max(0, (cap - max(0, kv_plan.prefill_bytes - kv_plan.held_bytes)) // kv_plan.held_bytes)
