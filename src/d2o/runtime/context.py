"""Compress once, answer many: a compressed context that any number of questions are asked of.

``compress`` prefills a context (a document, a conversation's earlier turns) and compresses it
to a budget without any question in sight; ``CompressedContext.ask`` feeds each question to a
cache of its own that reads the context's keys and values in place (``engine.shared``: never
written, held once by the questions' batch) and decodes, so a question never sees another's
tokens and asking never changes the context. This is the
evaluation's ``--protocol context``, and the server's compressed prefixes, paid for once.

A context is saved to one safetensors file: the layers' tensors, and beside them (in its
metadata) the method, its options, the budget, the token ids and what identifies the model.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from d2o.budget import EVICT_EVERY, Budget
from d2o.engine.cache import CompressedCache
from d2o.engine.quantization import KVQuantization
from d2o.engine.report import CacheReport
from d2o.errors import D2OError
from d2o.methods.base import Method
from d2o.runtime.decoding import Batch, Sampling, Sequence, seconds_since
from d2o.runtime.generation import Generation, check_memory, resolve
from d2o.runtime.prompts import as_list, check_length, encode, stop_token_ids

FORMAT = 3  # the layout of a saved context; a file of another layout is refused
DEFAULT_METHOD = "d2o-novelty"  # the method kept for questions that come after compression


def check_asks_later(method: Method) -> None:
    """Refuse a method whose first compression comes after the first decode step: there it would
    be the question's pass, and the compression would see the question."""
    if method.compress_after_forward > 1:
        raise D2OError(f"{method.name} first compresses after the first decode step, which after a compressed "
                       f"context is the question's pass: it would see the question; give it the whole prompt "
                       f"(d2o generate, --protocol prompt) instead")


@dataclass
class CompressedContext:
    """A context compressed to ``budget`` by ``method``, ready for questions.

    ``ids``: the context's token ids; ``cache``: its compressed cache (one row); ``logits``,
    ``positions``: the next-token logits after it and the position its next token takes.
    ``method_name`` and ``options`` rebuild the method when the context is loaded."""

    model: object
    tokenizer: object
    method: Method
    method_name: str
    options: dict
    ids: list[int]
    chat: bool
    cache: CompressedCache
    logits: torch.Tensor
    positions: torch.Tensor
    prefill_seconds: float = 0.0
    stop_ids: frozenset[int] = field(default=frozenset())
    conversation: list[dict] | None = None  # the context's messages, when compressed as a conversation

    @property
    def budget(self) -> Budget:
        return self.cache.budget

    @property
    def report(self) -> CacheReport:
        """What the compressed context holds, layer by layer."""
        return self.cache.report()

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    def question_ids(self, question: str | list[dict], chat: bool | None = None) -> list[int]:
        """The token ids ``question`` adds after the context: as written, or (``chat``) a user turn
        (or turns) after the context's conversation, ready for the answer."""
        return question_ids(self.tokenizer, question, self.chat if chat is None else chat, self.conversation)

    def ask(self, questions: str | list[dict] | list[str | list[dict]], max_new_tokens: int = 32, *,
            chat: bool | None = None, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
            seed: int | None = None, stop: tuple[str, ...] = ()) -> Generation:
        """Answer ``questions`` (one, or a list answered as one batch), each from the compressed
        context alone. Greedy by default (see ``generate`` for the sampling options); ``chat``: a
        question is a user turn of the model's chat template (by default, as the context was
        compressed). ``Generation.text`` is the answer to a single question."""
        asked = as_list(questions)
        if not asked:
            raise D2OError("no question to ask")
        ids = [self.question_ids(question, chat) for question in asked]
        check_length(self.model, len(self.ids) + max(map(len, ids)), max_new_tokens)
        sampling = Sampling(temperature, top_p, seed, top_k)
        sequences = [Sequence(self.tokenizer, max_new_tokens, sampling, self.stop_ids, stop) for _ in ids]
        start = time.perf_counter()
        batch = self.answer_batch(ids, sequences)
        batch.run()
        seconds = time.perf_counter() - start
        return Generation.of(sequences, seconds, 0.0)

    def answer_batch(self, questions: list[list[int]], sequences: list[Sequence], shared_prefix: bool = True) -> Batch:
        """A batch ready to decode: each question's token ids fed to its own copy of the context
        (the sequences' rows, in order), the rows then joined. ``shared_prefix``: the copies read the
        context's keys and values in place, held once by the batch (``CompressedCache.copy``); False:
        each row holds its own copy of them."""
        batches = []
        for question, sequence in zip(questions, sequences):
            if not question:
                raise D2OError("the question is empty")
            sequence.prompt_tokens = len(self.ids)
            batch = Batch(self.model, self.cache.copy(shared_prefix), [sequence], self.logits, self.positions)
            start = time.perf_counter()
            batch.feed([question])
            sequence.prefill_seconds = seconds_since(start, self.logits.device)
            batches.append(batch)
        first = batches[0]
        for batch in batches[1:]:
            first.join(batch)
        return first

    def extend(self, more: str | list[dict], chat: bool | None = None) -> CompressedContext:
        """A new context: this one with ``more`` fed after it (text, or with ``chat`` more turns of
        the conversation) and compressed back to the budget; this one is unchanged."""
        chat = self.chat if chat is None else chat
        if chat and not isinstance(more, str):
            turns = list(more)
            if not self.chat:
                raise D2OError("more turns need a context compressed as a conversation (compress(..., chat=True))")
            ids = continuation_ids(self.tokenizer, self.conversation, turns, generation_prompt=False)
            return self.extend_ids(ids, self.conversation + turns)
        if chat:
            return self.extend([{"role": "user", "content": more}], chat=True)
        return self.extend_ids(self.question_ids(more, chat=False))

    def extend_ids(self, ids: list[int], conversation: list[dict] | None = None) -> CompressedContext:
        """``extend`` by token ids (``conversation``: the messages the context then holds)."""
        if not ids:
            raise D2OError("nothing to extend the context with")
        check_length(self.model, len(self.ids) + len(ids) + 1)
        batch = Batch(self.model, self.cache.copy(), [Sequence(self.tokenizer, 1)], self.logits, self.positions)
        start = time.perf_counter()
        batch.feed([ids])
        seconds = seconds_since(start, self.logits.device)
        return replace(self, ids=self.ids + list(ids), cache=batch.cache, logits=batch.logits,
                       positions=batch.positions, prefill_seconds=self.prefill_seconds + seconds,
                       conversation=conversation if conversation is not None else self.conversation)

    # -- saving and loading -----------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write the context to ``path`` (a safetensors file): tensors, and in its metadata the
        method, options, budget, token ids and the model's identity."""
        from safetensors.torch import save_file

        path = Path(path)
        tensors, cache_meta = self.cache.state_dict()
        tensors = {**tensors, "logits": self.logits, "positions": self.positions}
        meta = {
            "format": FORMAT, "d2o": _version(), "model": model_identity(self.model),
            "method": self.method_name, "options": self.options, "budget": str(self.budget),
            "min_tokens": self.budget.min_tokens, "ratio": self.budget.ratio, "tokens": self.budget.tokens,
            "floor_given": self.budget.floor_given, "chat": self.chat, "conversation": self.conversation,
            "ids": self.ids, **cache_meta,
            "kv": None if self.cache.quantization is None else asdict(self.cache.quantization),
        }
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path),
                      metadata={"d2o_context": json.dumps(meta, default=str)})
        except OSError as error:
            raise D2OError(f"cannot write the context to {str(path)!r}: {error.strerror or error}") from None
        return path


def compress(model, tokenizer, context: str | list[dict], method: str | Method = DEFAULT_METHOD,
             budget: Budget | str | float = 0.2, *, chat: bool = False, min_tokens: int | None = None,
             evict_every: int = EVICT_EVERY, kv_bits: int | KVQuantization | None = None,
             prefill_chunk: int | None = None, questions: list | None = None, kv_memory: int | None = None,
             **method_options) -> CompressedContext:
    """Prefill ``context`` and compress it to ``budget`` with ``method``, with no question in sight.

    ``context``: a text, or (``chat=True``) a conversation (a list of messages; a text is one user
    turn) in the model's chat template, without the assistant's prompt: the questions add it.
    Returns a ``CompressedContext``; ``ask`` it any number of questions, ``save`` it to a file.
    ``evict_every``: its answers evict in batches of that many steps; ``kv_bits``: its keys and
    values are stored at that many bits (``CompressedCache``). ``prefill_chunk``: the context is
    prefilled that many tokens at a time, compressed after each chunk. ``questions``, if known
    before: shown (one after the other, after the context) to a method that scores with its question,
    after each chunk and the last. ``kv_memory``: bytes the compression may hold at its peak (the
    memory plan): a context that needs more is refused before the model runs.
    """
    name = method if isinstance(method, str) else method.name
    method, budget = resolve(method, budget, min_tokens, **method_options)
    if chat:
        conversation = [{"role": "user", "content": context}] if isinstance(context, str) else list(context)
        ids = conversation_ids(tokenizer, conversation)
    else:
        conversation = None
        ids = encode(tokenizer, [context])[0]
    question = [token for asked in questions for token in question_ids(tokenizer, asked, chat, conversation)] \
        if questions else None
    return compress_ids(model, tokenizer, ids, method, budget, name=name, options=dict(method_options),
                        conversation=conversation, evict_every=evict_every, kv_bits=kv_bits,
                        prefill_chunk=prefill_chunk, question=question, kv_memory=kv_memory)


def compress_ids(model, tokenizer, ids: list[int], method: Method, budget: Budget, *, name: str | None = None,
                 options: dict | None = None, conversation: list[dict] | None = None,
                 evict_every: int = EVICT_EVERY, kv_bits: int | KVQuantization | None = None,
                 prefill_chunk: int | None = None, question: list[int] | None = None,
                 kv_memory: int | None = None) -> CompressedContext:
    """``compress`` of token ids, with a method object and a parsed budget (checked against each
    other: ``resolve``); ``conversation``: the messages ``ids`` are, if they are a conversation;
    ``question``: token ids asked after the context, if known before it is compressed."""
    check_asks_later(method)
    check_length(model, len(ids) + 1 + len(question or ()))
    if kv_memory is not None:
        check_memory(model, method, budget, [ids], 1, kv_memory, evict_every, kv_bits, prefill_chunk,
                     question is not None)
    cache = CompressedCache(model, method, budget, tokenizer=tokenizer, evict_every=evict_every, kv_bits=kv_bits,
                            prefill_chunk=prefill_chunk)
    stops = stop_token_ids(model, tokenizer)
    batch = Batch.prefill(model, cache, [ids], [Sequence(tokenizer, 1, stop_ids=stops)], question=question)
    return CompressedContext(model, tokenizer, method, name or method.name, options or {}, list(ids),
                             conversation is not None, cache, batch.logits, batch.positions,
                             batch.sequences[0].prefill_seconds, stops, conversation)


def question_ids(tokenizer, question: str | list[dict], chat: bool, conversation: list[dict] | None) -> list[int]:
    """The token ids ``question`` adds after a context: as written, or (``chat``) a user turn (or
    turns) after the context's ``conversation``, ready for the answer."""
    if not chat:
        if not isinstance(question, str):
            raise D2OError("a question as messages needs the chat template (chat=True)")
        if not question.strip():
            raise D2OError("the question is empty")
        return tokenizer(question, add_special_tokens=False).input_ids
    if conversation is None:
        raise D2OError("a chat question needs a context compressed as a conversation (compress(..., chat=True))")
    turns = [{"role": "user", "content": question}] if isinstance(question, str) else list(question)
    return continuation_ids(tokenizer, conversation, turns)


def conversation_ids(tokenizer, conversation: list[dict]) -> list[int]:
    """The token ids of ``conversation`` in the chat template, ending after its last turn."""
    from jinja2 import TemplateError

    if not getattr(tokenizer, "chat_template", None):
        raise D2OError("this model's tokenizer has no chat template: compress the context as text (chat=False)")
    if not conversation or not any(str(turn.get("content") or "").strip() for turn in conversation):
        raise D2OError("the context is empty")
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=False)
    except TemplateError as error:
        raise D2OError(f"the model's chat template refuses these messages: {error}") from None
    return tokenizer(text, add_special_tokens=False).input_ids


def continuation_ids(tokenizer, conversation: list[dict], turns: list[dict],
                     generation_prompt: bool = True) -> list[int]:
    """The token ids ``turns`` add after ``conversation`` in the chat template, through the
    assistant's prompt (unless ``generation_prompt`` is False). Refused when the template writes
    the earlier turns differently once more follow (their tokens would not be the compressed ones)."""
    from d2o.runtime.prompts import chat_text

    if not any(str(turn.get("content") or "").strip() for turn in turns):
        raise D2OError("the question is empty")
    before = conversation_ids(tokenizer, conversation)
    whole = tokenizer(chat_text(tokenizer, conversation + turns) if generation_prompt
                      else tokenizer.apply_chat_template(conversation + turns, tokenize=False),
                      add_special_tokens=False).input_ids
    if whole[: len(before)] != before:
        raise D2OError("the model's chat template writes the earlier turns differently once a turn follows: "
                       "the compressed context is not a prefix of the conversation with the question")
    return whole[len(before):]


def load_context(path: str | Path, model, tokenizer=None) -> CompressedContext:
    """A context that ``CompressedContext.save`` wrote, on ``model`` (which must be the model it was
    compressed with, in the same dtype, with the same d2o version). ``tokenizer``: the model's (by
    default, the one saved with it)."""
    from safetensors import SafetensorError, safe_open

    from d2o.methods import get_method

    path = Path(path)
    if not path.is_file():
        raise D2OError(f"no context file {str(path)!r}")
    try:
        with safe_open(str(path), framework="pt") as handle:
            raw = (handle.metadata() or {}).get("d2o_context")
    except (SafetensorError, OSError) as error:
        raise D2OError(f"{path} is not a saved context (not a safetensors file: {error})") from None
    if raw is None:
        raise D2OError(f"{path} is a safetensors file but not a context that d2o saved")
    meta = json.loads(raw)
    if meta.get("format") != FORMAT or meta.get("d2o") != _version():
        raise D2OError(f"{path} was saved by d2o {meta.get('d2o')} (format {meta.get('format')}); this is d2o "
                       f"{_version()} (format {FORMAT}): compress the context again")
    identity = model_identity(model)
    differs = sorted(key for key in identity if meta["model"].get(key) != identity[key])
    if differs:
        raise D2OError(f"{path} was compressed with another model ({', '.join(differs)} differ: "
                       f"{meta['model'].get('name')!r}, {meta['model'].get('dtype')}); load it with that model")
    from safetensors.torch import load_file

    device = next(model.parameters()).device
    tensors = load_file(str(path), device=str(device))
    method = get_method(meta["method"], **meta["options"])
    budget = Budget(ratio=meta["ratio"], tokens=meta["tokens"], min_tokens=meta["min_tokens"],
                    floor_given=meta["floor_given"])
    quantization = None if meta["kv"] is None else KVQuantization(**meta["kv"])
    cache = CompressedCache(model, method, budget, tokenizer=tokenizer, evict_every=meta["evict_every"],
                            kv_bits=quantization)
    cache.load_state_dict(tensors, meta, next(model.parameters()).dtype)
    if tokenizer is None:
        tokenizer = cache.tokenizer
    return CompressedContext(model, tokenizer, method, meta["method"], meta["options"], meta["ids"], meta["chat"],
                             cache, tensors["logits"], tensors["positions"], 0.0, stop_token_ids(model, tokenizer),
                             meta["conversation"])


def model_identity(model) -> dict:
    """What a saved context must match: the model's name, its configuration, a digest of weights
    that differ between any two models of one configuration, and the dtype."""
    config = model.config.to_dict()
    name = config.pop("_name_or_path", "")
    for volatile in ("transformers_version", "dtype", "torch_dtype", "_attn_implementation_autoset"):
        config.pop(volatile, None)
    config = json.dumps(config, sort_keys=True, default=str)
    embeddings = model.get_input_embeddings().weight
    digest = hashlib.sha256(embeddings[:16].detach().float().cpu().numpy().tobytes()).hexdigest()[:16]
    return {"name": name, "config": hashlib.sha256(config.encode()).hexdigest()[:16], "weights": digest,
            "dtype": str(embeddings.dtype).removeprefix("torch.")}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("d2o")
    except PackageNotFoundError:
        return "unknown"
