"""``NAME=VALUE`` options from the command line (method, task and component options), typed."""

from __future__ import annotations

import re

from d2o.errors import D2OError


def whole(value) -> bool:
    """A count: an int, not a bool (1.5 or true is no number of tokens)."""
    return isinstance(value, int) and not isinstance(value, bool)


def option_texts(pairs: list[str], flag: str = "--option", prefix: str = "") -> dict[str, str]:
    """``["split=3:1", "alpha=0.3"]`` -> ``{"split": "3:1", "alpha": "0.3"}`` (dashes in names become _).
    ``prefix``: what the user wrote before each pair (``d2o.`` for ``--option d2o.split=3:1``), for messages."""
    options = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name.strip():
            raise D2OError(f"{flag} {prefix + pair!r}: expected {'METHOD.' if prefix else ''}NAME=VALUE")
        name = name.strip().replace("-", "_")
        if name in options:  # the last would win silently
            raise D2OError(f"{flag} {prefix}{name} given twice ({options[name]!r} and {text.strip()!r})")
        options[name] = text.strip()
    return options


def parse_options(pairs: list[str], flag: str = "--option", prefix: str = "") -> dict:
    """``["split=3:1", "alpha=0.3"]`` -> ``{"split": (3, 1), "alpha": 0.3}``, each value by ``parse_value``."""
    return {name: parse_value(text) for name, text in option_texts(pairs, flag, prefix).items()}


def parse_method_options(pairs: list[str]) -> dict[str, dict]:
    """``["kvzip.heads=adaptive"]`` -> ``{"kvzip": {"heads": "adaptive"}}`` (``--option METHOD.NAME=VALUE``)."""
    per_method: dict[str, list[str]] = {}
    for pair in pairs:
        target, dot, rest = pair.partition(".")
        if not dot:
            raise D2OError(f"--option {pair!r}: expected METHOD.NAME=VALUE")
        per_method.setdefault(target, []).append(rest)
    return {target: parse_options(rest, prefix=f"{target}.") for target, rest in per_method.items()}


def parse_value(text: str):
    """A tuple for ``a:b`` or ``a,b``; then bool, None, int, float; else the text itself."""
    if ":" in text or "," in text:
        return tuple(parse_value(part) for part in text.replace(":", ",").split(",") if part)
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def split_list(text: str | None, kind=str) -> tuple | None:
    """``"500,1000"`` -> ``(500, 1000)``; None stays None; a bad item names itself."""
    if text is None:
        return None
    items = []
    for item in (v.strip() for v in text.split(",")):
        if not item:
            continue
        try:
            items.append(kind(item))
        except ValueError:
            what = {int: "a whole number", float: "a number"}.get(kind, f"a {kind.__name__}")
            raise D2OError(f"{item!r} in {text!r} is not {what}") from None
    return tuple(items)


UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """Bytes from ``512MB`` (decimal units), ``2GiB`` (binary), ``1.5GB`` or a plain number of bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if unit not in UNITS:
        raise D2OError(f"memory size {text!r}: expected a number of bytes or a number with a unit "
                       f"(KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 512MB or 2GiB")
    size = int(float(match.group(1)) * UNITS[unit])
    if size < 1:
        raise D2OError(f"memory size {text!r} must be at least 1 byte")
    return size


def distinct(items: tuple, what: str) -> tuple:
    """``items``, refused when one is given twice (a table would hold its rows twice)."""
    twice = sorted({item for item in items if items.count(item) > 1}, key=str)
    if twice:
        raise D2OError(f"{', '.join(map(str, twice))} given twice in {what}")
    return items


KV_BITS = (8, 4, 2)  # the bit widths a cache stores keys and values at (engine/quantization)


def check_prefill_chunk(chunk) -> int | None:
    """``prefill_chunk``/``--prefill-chunk``: a whole number of tokens >= 1, or None for a prefill whole."""
    if chunk is not None and (not whole(chunk) or chunk < 1):
        raise D2OError(f"prefill_chunk={chunk!r} must be a whole number of tokens >= 1 (or None: whole)")
    return chunk


def check_kv_bits(bits) -> int | None:
    """``kv_bits``/``--kv-bits``: 8, 4 or 2, or None (also "none") for the model's own dtype."""
    if bits is None or (isinstance(bits, str) and bits.strip().lower() == "none"):
        return None
    try:
        value = int(bits) if not isinstance(bits, bool) else None
    except (TypeError, ValueError):
        value = None
    if value not in KV_BITS or (isinstance(bits, float) and bits != value):
        raise D2OError(f"kv_bits={bits!r}: keys and values are stored at 8, 4 or 2 bits (or none: the model's dtype)")
    return value


HEADS = ("even", "adaptive")  # how a method shares a layer's budget among its KV heads (its ``heads`` option)
