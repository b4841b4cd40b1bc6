"""Scores: SQuAD's and CoQA's F1 and exact match, ROUGE-L (LongBench's and TruthfulQA's variants),
and LongBench's official metrics.

LongBench's metrics are restated from its ``metrics.py`` (v1): QA F1 over SQuAD-normalised words;
ROUGE-L as the ``rouge`` package computes it (sentences split on ".", summary-level union LCS
over distinct words); classification with partial credit; retrieval and count accuracy over the
numbers in the answer; code edit similarity (fuzzywuzzy's ratio, which is difflib's without
python-Levenshtein) on the first line that is not a comment. TruthfulQA's ROUGE is another one,
``rouge_score``'s ROUGE-Lsum (lower case, words of letters and digits, sentences on lines,
occurrences counted), restated as ``rouge_lsum``.
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from statistics import fmean

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def token_f1(prediction_tokens: list[str], gold_tokens: list[str]) -> float:
    common = Counter(prediction_tokens) & Counter(gold_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction_tokens), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, gold: str) -> float:
    """SQuAD / LongBench QA F1 between one prediction and one gold answer."""
    return token_f1(normalize_answer(prediction).split(), normalize_answer(gold).split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def best_over(metric, prediction: str, golds: list[str]) -> float:
    """The best score against any of the gold answers (SQuAD's and LongBench's rule)."""
    return max((metric(prediction, gold) for gold in golds), default=0.0)


def qa_scores(prediction: str, golds: list[str]) -> dict[str, float]:
    """SQuAD's F1 and exact match, each the best over the gold answers."""
    return {"f1": best_over(qa_f1, prediction, golds), "exact_match": best_over(exact_match, prediction, golds)}


def leave_one_out(metric, prediction: str, golds: list[str]) -> float:
    """CoQA's rule: with n > 1 gold answers (repeats count), the mean over each one left out of the
    best score against the others, so a prediction is scored as one more annotator would be."""
    if len(golds) <= 1:
        return best_over(metric, prediction, golds)
    return fmean(best_over(metric, prediction, golds[:i] + golds[i + 1:]) for i in range(len(golds)))


def coqa_f1(prediction: str, gold: str) -> float:
    """CoQA's F1: SQuAD's, except that an answer with no words left after normalisation scores 1
    against another such answer (its official scorer's rule; SQuAD v1.1 scores it 0)."""
    prediction_tokens, gold_tokens = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not prediction_tokens or not gold_tokens:
        return float(prediction_tokens == gold_tokens)
    return token_f1(prediction_tokens, gold_tokens)


def coqa_scores(prediction: str, golds: list[str]) -> dict[str, float]:
    """CoQA's official F1 and exact match (SQuAD's normalisation, ``leave_one_out`` over the golds)."""
    return {"f1": leave_one_out(coqa_f1, prediction, golds),
            "exact_match": leave_one_out(exact_match, prediction, golds)}


# -- ROUGE-L ------------------------------------------------------------------------------------
def _lcs_table(a: list[str], b: list[str]) -> list[list[int]]:
    """table[i][j]: the length of the longest common subsequence of a[:i] and b[:j]."""
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, word_a in enumerate(a, 1):
        for j, word_b in enumerate(b, 1):
            table[i][j] = table[i - 1][j - 1] + 1 if word_a == word_b else max(table[i - 1][j], table[i][j - 1])
    return table


def _lcs_words(a: list[str], b: list[str]) -> list[str]:
    """The longest common subsequence of two word lists that the ``rouge`` package reconstructs:
    several may exist, and which one is taken decides which distinct words count, so its tie
    rule is kept (on a tie, step back in ``b``)."""
    table = _lcs_table(a, b)
    words, i, j = [], len(a), len(b)
    while i and j:
        if a[i - 1] == b[j - 1]:
            words.append(a[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words[::-1]


def _sentences(text: str) -> list[list[str]]:
    """Split on "." as the package does: a part of blanks only is a sentence of one empty word."""
    return [" ".join(part.split()).split(" ") for part in text.split(".") if part]


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F as the ``rouge`` package (LongBench's) computes it: sentences split on ".",
    the union of each reference sentence's LCS with every prediction sentence, counted over
    distinct words; F = 2PR / (P + R + 1e-8). An empty text scores 0."""
    hypothesis, references = _sentences(prediction), _sentences(reference)
    if not hypothesis or not references:
        return 0.0
    hit: set[str] = set()
    for ref in references:
        for hyp in hypothesis:
            hit.update(_lcs_words(ref, hyp))
    reference_words = {w for sentence in references for w in sentence}
    hypothesis_words = {w for sentence in hypothesis for w in sentence}
    recall, precision = len(hit) / len(reference_words), len(hit) / len(hypothesis_words)
    return 2 * precision * recall / (precision + recall + 1e-8)


# -- ROUGE-Lsum (rouge_score's) ----------------------------------------------------------------
_NOT_ALPHANUMERIC = re.compile(r"[^a-z0-9]+")


def _lsum_words(sentence: str) -> list[str]:
    """rouge_score's default tokenizer (no stemming): lower case, anything but a-z and 0-9 a blank."""
    return _NOT_ALPHANUMERIC.sub(" ", sentence.lower()).split()


def _lcs_positions(reference: list[str], candidate: list[str]) -> set[int]:
    """The positions in ``reference`` of the LCS rouge_score reads out (on a tie it steps back in
    the reference); which one it takes decides the union over the candidate's sentences."""
    table = _lcs_table(reference, candidate)
    positions, i, j = set(), len(reference), len(candidate)
    while i and j:
        if reference[i - 1] == candidate[j - 1]:
            positions.add(i - 1)
            i, j = i - 1, j - 1
        elif table[i][j - 1] > table[i - 1][j]:
            j -= 1
        else:
            i -= 1
    return positions


def rouge_lsum(prediction: str, reference: str) -> float:
    """ROUGE-Lsum F as TruthfulQA and lm-eval compute it (``rouge_score``'s ``rougeLsum`` after
    their " . " -> ".\\n"): sentences are the lines, each reference sentence's LCS with every
    prediction sentence united, a word counted as a hit at most as often as it occurs in both
    texts; F = 2PR / (P + R). An empty text scores 0."""
    def sentences(text: str) -> list[list[str]]:
        return [_lsum_words(line) for line in text.replace(" . ", ".\n").split("\n")]

    hypothesis, references = sentences(prediction), sentences(reference)
    hypothesis_left = Counter(word for sentence in hypothesis for word in sentence)
    reference_left = Counter(word for sentence in references for word in sentence)
    total_hypothesis, total_reference = hypothesis_left.total(), reference_left.total()
    if not total_hypothesis or not total_reference:
        return 0.0
    hits = 0
    for sentence in references:
        for position in set().union(*(_lcs_positions(sentence, hyp) for hyp in hypothesis)):
            word = sentence[position]
            if hypothesis_left[word] and reference_left[word]:
                hits += 1
                hypothesis_left[word] -= 1
                reference_left[word] -= 1
    if not hits:
        return 0.0
    recall, precision = hits / total_reference, hits / total_hypothesis
    return 2 * precision * recall / (precision + recall)


# -- LongBench's other metrics ------------------------------------------------------------------
def classification_score(prediction: str, gold: str, all_classes: list[str]) -> float:
    """Partial credit 1/len(matches) when the gold class is among the class names in the answer.

    A class name inside the gold label but not equal to it (e.g. "City" for "Location City") is
    dropped first; as in LongBench, the list is filtered while it is walked, so the name after a
    dropped one is not checked (kept for comparable scores).
    """
    matches = [name for name in all_classes if name in prediction]
    index = 0
    while index < len(matches):
        name = matches[index]
        if name in gold and name != gold:
            matches.pop(index)  # LongBench's loop then skips the name that slides into this place
        index += 1
    return 1.0 / len(matches) if gold in matches else 0.0


def retrieval_score(prediction: str, gold: str) -> float:
    """Share of the numbers in the answer that are the gold paragraph's ("Paragraph 12")."""
    found = re.findall(r"Paragraph (\d+)", gold)
    numbers = re.findall(r"\d+", prediction)
    if not found or not numbers:
        return 0.0
    return sum(n == found[0] for n in numbers) / len(numbers)


def count_score(prediction: str, gold: str) -> float:
    """Share of the numbers in the answer equal to the gold count (as strings)."""
    numbers = re.findall(r"\d+", prediction)
    return sum(n == str(gold) for n in numbers) / len(numbers) if numbers else 0.0


def code_sim_score(prediction: str, gold: str) -> float:
    """Edit similarity of the first line without ` # or // to the gold line, in [0, 1]."""
    lines = prediction.lstrip("\n").split("\n")
    line = next((text for text in lines if "`" not in text and "#" not in text and "//" not in text), "")
    if line == gold:
        return 1.0
    if not line or not gold:
        return 0.0
    return round(100 * difflib.SequenceMatcher(None, line, gold).ratio()) / 100


def final_number(text: str) -> str | None:
    """The answer of a chain of thought: the number after the last "the answer is", else the last number."""
    cleaned = text.replace(",", "")
    stated = re.findall(r"answer is\s*\$?\s*(-?\d+(?:\.\d+)?)", cleaned, flags=re.IGNORECASE)
    numbers = re.findall(r"-?\d+(?:\.\d+)?", cleaned)
    value = stated[-1] if stated else (numbers[-1] if numbers else None)
    if value is None:
        return None
    number = float(value)
    return str(int(number)) if number.is_integer() else str(number)


def string_match_all(prediction: str, references: list[str]) -> float:
    """RULER's ``string_match_all`` for one sample: the share of the references the prediction
    contains, case-insensitively (RULER prints the mean x100)."""
    said = prediction.lower()
    return sum(reference.lower() in said for reference in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    """RULER's ``string_match_part`` for one sample: 1 if the prediction contains any reference."""
    said = prediction.lower()
    return float(any(reference.lower() in said for reference in references))
