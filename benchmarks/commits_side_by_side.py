"""One ``d2o bench`` command run on two commits in turn (A B A B ...), side by side: whether a change
meant to keep behaviour (a reshape of the engine) made it slower.

Each commit runs from a worktree of its own with this checkout's virtual environment. A run's
times vary with the machine's load; its ratios to a baseline timed in the same process vary far
less: the time of the row of method ``--against`` at the same length and batch (by default the
command's own ratio: ``time_vs_full``; ``vs_sdpa`` for the prefill). Per row the table gives, for
each commit, the median over the rounds of the time and of that ratio, and the second commit's
median ratio over the first's::

    python benchmarks/commits_side_by_side.py --before f26766a --after HEAD --rounds 5 \\
        --against "full, budget-sized" -- bench decode --methods full,d2o,d2o-plus \\
        --lengths 1024,4096 --evict-every 8 --budget-sized-full
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("length", "batch", "method", "budget", "evict_every")  # what names a row
TIMES = {"decode": ("ms_per_step", "time_vs_full"), "prefill": ("seconds", "vs_sdpa")}


def worktree(revision: str, folder: Path) -> Path:
    path = folder / revision.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(path), revision], check=True,
                   capture_output=True)
    return path


def run(tree: Path, args: list[str], out: Path) -> list[dict]:
    """The rows the command wrote (a prefill's, one per length and method)."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    subprocess.run([sys.executable, "-m", "d2o", *args, "--out", str(out)], check=True, cwd=tree, env=env)
    rows = json.loads(next(out.glob("*.json")).read_text())["rows"]
    if args[1] != "prefill":
        return rows
    suffix = "_over_sdpa"
    return [{"length": row["length"], "method": name[:-len(suffix)], "seconds": row[name[:-len(suffix)] + "_s"],
             "vs_sdpa": value} for row in rows for name, value in row.items() if name.endswith(suffix)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True)
    parser.add_argument("--after", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--against", help="the method whose time in the same run each ratio is to")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- bench decode|prefill OPTIONS")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    time, ratio = TIMES[command[1]]
    ratio_name = f"vs {args.against}" if args.against else ratio
    found: dict[tuple, dict[str, list]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        trees = {revision: worktree(revision, Path(scratch)) for revision in (args.before, args.after)}
        try:
            for round_ in range(args.rounds):
                for revision, tree in trees.items():
                    rows = run(tree, command, Path(scratch) / f"{revision}-{round_}".replace("/", "_"))
                    base = {(row["length"], row.get("batch")): row[time] for row in rows
                            if row["method"] == args.against}
                    for row in rows:
                        cell = found.setdefault(tuple(row.get(key) for key in KEYS), {})
                        share = row[time] / base[row["length"], row.get("batch")] if args.against else row[ratio]
                        cell.setdefault(revision, []).append((row[time], share))
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    print(f"| {' | '.join(KEYS)} | {time} {args.before} | {time} {args.after} | {ratio_name} {args.before} | "
          f"{ratio_name} {args.after} | after / before |")
    print("|" + "---|" * (len(KEYS) + 5))
    for key, cell in found.items():
        medians = {revision: [statistics.median(values) for values in zip(*cell[revision])] for revision in cell}
        before, after = medians[args.before], medians[args.after]
        print(f"| {' | '.join(map(str, key))} | {before[0]:.4g} | {after[0]:.4g} | {before[1]:.4g} | {after[1]:.4g} | "
              f"{after[1] / before[1]:.3f} |")


if __name__ == "__main__":
    main()
