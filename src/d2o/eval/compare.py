"""Two methods compared sample by sample on what ``d2o eval`` wrote, with a bootstrap interval.

A NIAH cell of 15 prompts moves 0.022 per fact word and a passkey cell of 20 prompts 0.05 per
prompt: whether one method's mean above another's is more than that takes the paired differences,
not the two means. Each difference is one sample both methods ran at that budget (the full cache,
run once at budget 1, pairs with every budget); for perplexity, one ``window`` of the text's curve
(the log of its perplexity), so the difference of means is the log of the perplexities' ratio.
Folders of the same task, protocol and model (other seeds, other haystacks) are also pooled. The
same method run two ways (prefilled in chunks and whole, quantized and not) pairs across two
folders of the same samples: ``against_paths``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from d2o.errors import D2OError
from d2o.eval.results import FULL_BUDGET, SampleStore, budget_order
from d2o.eval.sweep import recorded_identity

RESAMPLE_BLOCK = 1 << 20  # bootstrap indices drawn at once (8 MiB): 10,000 draws of 5,000 samples would be 400 MiB


@dataclass(frozen=True)
class Comparison:
    """One budget of ``method`` against ``against``: ``n`` paired units (samples, or a text's windows),
    their means, the mean difference (method - against; log ratio for perplexity) and its interval."""

    results: str  # a folder, or "pooled: N folders"
    budget: str
    n: int
    mean: float
    mean_against: float
    difference: float
    low: float
    high: float
    better: int  # units where ``method`` did better (direction of the task's score)
    worse: int
    log_scale: bool  # perplexity: means and difference are of log perplexities

    def row(self) -> list[str]:
        if self.log_scale:  # shown as perplexities and their ratio
            means = [f"{math.exp(self.mean):.3f}", f"{math.exp(self.mean_against):.3f}"]
            gap = [f"x{math.exp(self.difference):.4f}", f"[x{math.exp(self.low):.4f}, x{math.exp(self.high):.4f}]"]
        else:
            means = [f"{self.mean:.3f}", f"{self.mean_against:.3f}"]
            gap = [f"{self.difference:+.3f}", f"[{self.low:+.3f}, {self.high:+.3f}]"]
        if self.n < 2:
            gap[1] = "-"
        return [self.results, self.budget, str(self.n), *means, *gap,
                f"{self.better} / {self.worse} / {self.n - self.better - self.worse}"]


@dataclass(frozen=True)
class Folder:
    path: Path
    group: tuple  # task, protocol, model: what may be pooled
    samples: tuple  # what draws the samples: the task's settings and the seed
    higher_is_better: bool
    log_scale: bool
    lines: list[dict]


def read_folder(path: Path) -> Folder:
    """A results folder of ``d2o eval``: its samples and what its config.json says it measured."""
    from d2o.eval.tasks import get_task  # the registry: whether a higher score is better

    for name in ("samples.jsonl", "config.json"):
        if not (path / name).is_file():
            raise D2OError(f"{path} holds no {name}: give folders that d2o eval wrote (its --out)")
    identity = recorded_identity(path / "config.json")
    task = get_task(identity["task"])
    group = (identity["task"], identity.get("protocol", "prompt"), identity.get("model"))
    lines = SampleStore(path / "samples.jsonl").read()
    settings = dict(identity.get("task_settings") or {})
    settings.pop(task.subtasks_option, None)  # the sub-tasks picked: pairs are of the samples both ran
    samples = (repr(settings), identity.get("seed"))
    return Folder(path, group, samples, task.higher_is_better, task.name == "perplexity", lines)


def _runs(folder: Folder, *methods: str) -> dict[tuple[str, str], dict[str, dict]]:
    """The folder's result lines by (method, budget), then sample; each of ``methods`` must be there."""
    runs: dict[tuple[str, str], dict[str, dict]] = defaultdict(dict)
    for line in folder.lines:
        runs[(line["method"], line["budget"])][line["sample_id"]] = line
    present = sorted({m for m, _ in runs})
    for name in methods:
        if name not in present:
            raise D2OError(f"{folder.path} holds no run of {name!r}; it holds {', '.join(present)}")
    return runs


def paired_units(folder: Folder, method: str, against: str,
                 against_folder: Folder | None = None) -> dict[str, tuple[list[float], list[float]]]:
    """Per budget of ``method``: the units both methods ran (``against``'s in ``against_folder``, if
    given), as two aligned lists."""
    if against_folder is None:
        runs = theirs_runs = _runs(folder, method, against)
    else:
        if (against_folder.group, against_folder.samples) != (folder.group, folder.samples):
            raise D2OError(f"{folder.path} and {against_folder.path} hold different samples (task, its settings, "
                           f"protocol, model or seed): their runs do not pair")
        runs, theirs_runs = _runs(folder, method), _runs(against_folder, against)
    pairs = {}
    for budget in sorted({b for m, b in runs if m == method}, key=budget_order):
        other = theirs_runs.get((against, budget)) or theirs_runs.get((against, FULL_BUDGET))
        if not other:
            continue
        ours, theirs = [], []
        for sample_id, line in sorted(runs[(method, budget)].items()):
            if sample_id in other:
                a, b = _units(line, folder), _units(other[sample_id], folder)
                if len(a) != len(b):
                    raise D2OError(f"{folder.path}: {sample_id!r} has {len(a)} windows for {method!r} and {len(b)} "
                                   f"for {against!r}; rerun one of them")
                ours += a
                theirs += b
        if ours:
            pairs[budget] = (ours, theirs)
    if not pairs:
        raise D2OError(f"{folder.path}: {method!r} and {against!r} share no sample at any budget")
    return pairs


def _units(line: dict, folder: Folder) -> list[float]:
    if folder.log_scale:  # perplexity: each window of the curve, as log perplexity
        return [math.log(value) for value in line.get("curve") or [line["score"]]]
    return [float(line["score"])]


def compare(paths: list[Path], method: str, against: str, resamples: int = 10_000, confidence: float = 0.95,
            seed: int = 0, against_paths: list[Path] | None = None) -> list[Comparison]:
    """``method`` against ``against`` in each folder (or in the folder of ``against_paths`` beside
    it) and, where several share task, protocol and model, pooled over them; a percentile bootstrap
    over the paired units (``resamples`` draws)."""
    if not 0 < confidence < 1:
        raise D2OError(f"confidence={confidence} must be between 0 and 1 (0.95: a 95% interval)")
    if resamples < 1:
        raise D2OError(f"resamples={resamples} must be at least 1")
    if against_paths is not None and len(against_paths) != len(paths):
        raise D2OError(f"{len(paths)} results folder(s) and {len(against_paths)} to compare against: give one "
                       f"--against-results folder for each")
    if method == against and against_paths is None:
        raise D2OError(f"compare {method!r} against another method, or against itself run another way "
                       f"(--against-results)")
    folders = [read_folder(Path(path)) for path in paths]
    others = [None] * len(folders) if against_paths is None else [read_folder(Path(path)) for path in against_paths]
    rng = np.random.default_rng(seed)
    comparisons = []
    groups: dict[tuple, list[tuple[Folder, dict]]] = defaultdict(list)
    for folder, other in zip(folders, others):
        pairs = paired_units(folder, method, against, other)
        groups[folder.group].append((folder, pairs))
        comparisons += [_compare(str(folder.path), budget, *units, folder, resamples, confidence, rng)
                        for budget, units in pairs.items()]
    for members in groups.values():
        if len(members) < 2:
            continue
        pooled: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
        for _, pairs in members:
            for budget, (ours, theirs) in pairs.items():
                pooled[budget][0].extend(ours)
                pooled[budget][1].extend(theirs)
        label = f"pooled: {len(members)} folders"
        comparisons += [_compare(label, budget, *pooled[budget], members[0][0], resamples, confidence, rng)
                        for budget in sorted(pooled, key=budget_order)]
    return comparisons


def _compare(results, budget, ours, theirs, folder: Folder, resamples, confidence, rng) -> Comparison:
    ours, theirs = np.asarray(ours, dtype=np.float64), np.asarray(theirs, dtype=np.float64)
    differences = ours - theirs
    means = _resampled_means(differences, resamples, rng)
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    sign = 1 if folder.higher_is_better else -1
    return Comparison(results, budget, len(differences), float(ours.mean()), float(theirs.mean()),
                      float(differences.mean()), float(low), float(high), int((sign * differences > 0).sum()),
                      int((sign * differences < 0).sum()), folder.log_scale)


def _resampled_means(differences: np.ndarray, resamples: int, rng) -> np.ndarray:
    """The means of ``resamples`` draws with replacement, drawn a block at a time so that the
    indices held never exceed ``RESAMPLE_BLOCK`` whatever the number of samples."""
    n = len(differences)
    per_block = max(1, RESAMPLE_BLOCK // n)
    return np.concatenate([differences[rng.integers(0, n, (min(per_block, resamples - start), n))].mean(axis=1)
                           for start in range(0, resamples, per_block)])


def markdown(comparisons: list[Comparison], method: str, against: str, confidence: float) -> str:
    """The comparisons as one table (a perplexity difference is a ratio, x1.01 = 1% higher)."""
    head = ["results", "budget", "n", method, against, f"{method} - {against}",
            f"{confidence:.0%} interval", f"{method} better / worse / same"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    lines += ["| " + " | ".join(item.row()) + " |" for item in comparisons]
    return "\n".join(lines) + "\n"
