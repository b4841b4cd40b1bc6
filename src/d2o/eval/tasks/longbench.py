"""LongBench (Bai et al. 2023), v1 format, from a folder of ``{dataset}.jsonl`` files.

No LongBench data is reachable here: point the ``data_dir`` option (``--task-option data_dir=DIR``)
at LongBench's ``data`` folder. The per-dataset prompts, answer lengths, middle truncation,
chat-template rule, first-line cut and metrics follow LongBench's ``pred.py``/``eval.py`` (restated; the prompts are the benchmark's
own strings), except that the truncation keeps the question after the context whole where it fits
(``truncate_middle``), counts no start-of-sequence token (``pred.py`` counts the one its tokenizer
adds: a one-token difference in the cut for such tokenizers), and samsum may end empty at its first
token (``pred.py`` forbids a first end-of-sequence or newline token). Scores are in [0, 1]
(LongBench prints them x100). The Chinese datasets are
not supported: their metrics need jieba's word segmentation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from d2o.errors import D2OError
from d2o.eval.metrics import classification_score, code_sim_score, count_score, qa_f1, retrieval_score, rouge_l
from d2o.eval.tasks.base import Sample, Task, asked, chat_prompt, register_task, take
from d2o.options import distinct, whole

PROMPTS = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the question asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
    "qasper": "You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "hotpotqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "2wikimqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "musique": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n\n{context}\n\n{input}",
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",
    "passage_retrieval_en": "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the abstract is from. The answer format must be like \"Paragraph 1\", \"Paragraph 2\", etc.\n\nThe answer is: ",
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}
# Answer length in tokens and metric of each dataset (LongBench's dataset2maxlen / dataset2metric).
SETTINGS = {
    "narrativeqa": (128, "qa_f1"),
    "qasper": (128, "qa_f1"),
    "multifieldqa_en": (64, "qa_f1"),
    "hotpotqa": (32, "qa_f1"),
    "2wikimqa": (32, "qa_f1"),
    "musique": (32, "qa_f1"),
    "gov_report": (512, "rouge"),
    "qmsum": (512, "rouge"),
    "multi_news": (512, "rouge"),
    "trec": (64, "classification"),
    "triviaqa": (32, "qa_f1"),
    "samsum": (128, "rouge"),
    "passage_count": (32, "count"),
    "passage_retrieval_en": (32, "retrieval"),
    "lcc": (64, "code_sim"),
    "repobench-p": (64, "code_sim"),
}
MIN_LENGTH = 2  # max_length: a first and a last part of one token at least
CHINESE = ("multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh")
NO_CHAT_TEMPLATE = {"trec", "triviaqa", "samsum", "lcc", "repobench-p"}  # few-shot or code: raw prompts
FIRST_LINE_ONLY = {"trec", "triviaqa", "samsum"}  # the scorer keeps the answer's first line
METRICS = {
    "qa_f1": lambda prediction, gold, record: qa_f1(prediction, gold),
    "rouge": lambda prediction, gold, record: rouge_l(prediction, gold),
    "classification": lambda prediction, gold, record: classification_score(prediction, gold, record["all_classes"]),
    "retrieval": lambda prediction, gold, record: retrieval_score(prediction, gold),
    "count": lambda prediction, gold, record: count_score(prediction, gold),
    "code_sim": lambda prediction, gold, record: code_sim_score(prediction, gold),
}


def base_name(dataset: str) -> str:
    """LongBench-E's ``qasper_e`` uses ``qasper``'s prompt, length and metric."""
    return dataset[:-2] if dataset.endswith("_e") else dataset


def read_records(path: Path, dataset: str) -> list[dict]:
    """The records of one JSONL file, each checked for the fields its dataset needs."""
    classified = SETTINGS[base_name(dataset)][1] == "classification"
    needed = ["input", "context", "answers"] + (["all_classes"] if classified else [])
    records = []
    with path.open(encoding="utf-8") as stream:
        for number, line in enumerate(stream, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise D2OError(f"{path}:{number}: not valid JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise D2OError(f"{path}:{number}: expected a JSON object")
            missing = [name for name in needed if name not in record]
            if missing:
                raise D2OError(f"{path}:{number}: missing field {', '.join(missing)}")
            if not isinstance(record["answers"], list) or not record["answers"]:
                raise D2OError(f"{path}:{number}: 'answers' must be a non-empty list")
            classes = record.get("all_classes")
            if classified and not (isinstance(classes, list) and classes and all(isinstance(c, str) for c in classes)):
                raise D2OError(f"{path}:{number}: 'all_classes' must be a non-empty list of class names")
            record["_line"] = number
            records.append(record)
    if not records:
        raise D2OError(f"{path}: no records")
    return records


def truncate_middle(tokenizer, prompt: str, max_length: int, question: str = "") -> tuple[str, str]:
    """LongBench's rule: over ``max_length`` tokens, keep the first and last max_length/2. The
    ``question`` ending the prompt (all after the context, fed after it under ``--protocol
    context``) stays whole where it fits: where the last half would cut into it (repobench-p's code
    can be long), the last part holds it and the first part is that much shorter. A question of
    max_length tokens or more is cut as LongBench cuts it. Returns the prompt and the end of it
    that asks: the question, or what the last half holds of it."""
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    if len(ids) <= max_length:
        return prompt, question
    half = max_length // 2
    # One token more than the question alone: a token may span the context's end and its start.
    needed = len(tokenizer(question, add_special_tokens=False).input_ids) + 1
    fits = needed < 2 * half
    tail = max(half, needed) if fits else half
    end = tokenizer.decode(ids[-tail:], skip_special_tokens=True)
    return tokenizer.decode(ids[: 2 * half - tail], skip_special_tokens=True) + end, question if fits else end


@register_task
@dataclass
class LongBench(Task):
    """``datasets``: names (``qasper``, ``qasper_e``...) whose ``{name}.jsonl`` lie in ``data_dir``
    (default: every supported one there). ``max_length``: prompt tokens after truncation (3500,
    LongBench's setting for 4K-position models; at least 2: a first and a last token; see
    ``truncate_middle`` for the question, kept whole). ``--limit``: records per dataset."""

    name = "longbench"
    summary = "LongBench (v1 JSONL from data_dir), its prompts, truncation and official metrics"
    metrics = ("score",)

    data_dir: str | None = None
    datasets: tuple[str, ...] = ()
    max_length: int = 3500

    def __post_init__(self):
        if not whole(self.max_length) or self.max_length < MIN_LENGTH:
            raise D2OError(f"longbench: max_length={self.max_length!r} must be a whole number >= {MIN_LENGTH}")
        if not self.data_dir:
            raise D2OError("longbench needs --task-option data_dir=DIR: a folder of LongBench {dataset}.jsonl files")
        folder = Path(self.data_dir)
        if not folder.is_dir():
            raise D2OError(f"LongBench data folder {self.data_dir!r} not found")
        self.datasets = distinct(tuple(self.datasets), "longbench's datasets")  # each would run twice
        for dataset in self.datasets:
            if base_name(dataset) in CHINESE:
                raise D2OError(f"LongBench dataset {dataset!r} is Chinese: not supported (its metric needs jieba)")
            if base_name(dataset) not in SETTINGS:
                raise D2OError(f"unknown LongBench dataset {dataset!r}; known: {', '.join(SETTINGS)}")
            if not (folder / f"{dataset}.jsonl").is_file():
                raise D2OError(f"LongBench file {folder / (dataset + '.jsonl')} not found")
        if not self.datasets:
            found = sorted(p.stem for p in folder.glob("*.jsonl") if base_name(p.stem) in SETTINGS)
            if not found:
                raise D2OError(f"no LongBench files in {self.data_dir}: expected e.g. qasper.jsonl, triviaqa.jsonl")
            self.datasets = tuple(found)

    def samples(self, tokenizer, limit, seed):
        samples = []
        for dataset in self.datasets:
            base = base_name(dataset)
            max_new_tokens = SETTINGS[base][0]
            records = read_records(Path(self.data_dir) / f"{dataset}.jsonl", dataset)
            for record in take(records, limit, seed):
                after_context = PROMPTS[base].split("{context}")[1].format(**record)
                prompt, question = truncate_middle(tokenizer, PROMPTS[base].format(**record), self.max_length,
                                                   after_context)
                special_tokens = True
                if base not in NO_CHAT_TEMPLATE:
                    prompt, special_tokens = chat_prompt(tokenizer, prompt)
                samples.append(Sample(
                    f"longbench-{dataset}-{record.get('_id', record['_line'])}", prompt, record["answers"],
                    max_new_tokens=max_new_tokens, stop=("\n",) if base == "samsum" else (),
                    special_tokens=special_tokens, question=asked(prompt, question),
                    meta={"subtask": dataset, "all_classes": record.get("all_classes"), "length": record.get("length")},
                ))
        return samples

    def answer(self, text):
        """The text as generated: LongBench's eval.py strips nothing (its code similarity only drops
        leading newlines, so the first line keeps its indentation; its ROUGE counts trailing blanks)."""
        return text

    def score(self, prediction, sample):
        dataset = base_name(sample.meta["subtask"])
        if dataset in FIRST_LINE_ONLY:
            prediction = prediction.lstrip("\n").split("\n")[0]
        metric = METRICS[SETTINGS[dataset][1]]
        record = {"all_classes": sample.meta.get("all_classes")}
        return {"score": max(metric(prediction, gold, record) for gold in sample.gold)}
