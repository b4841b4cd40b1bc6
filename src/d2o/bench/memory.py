"""Peak memory of a piece of torch code: on a GPU the allocator's peak; on the CPU the peak of the
process's resident memory, from the kernel's high-water mark (Linux), reset before the code runs.

The resident peak is what the machine must really hold (tensors, allocator slack, everything
else the code allocates), and reading it costs nothing, so the timed runs themselves are measured.
Freed heap is handed back to the kernel first (glibc's ``malloc_trim``), so that the code's
allocations cannot hide in memory an earlier run left resident, and glibc's threshold for serving
large blocks from their own mappings is fixed (``mallopt``): left to itself it rises after a large
block is freed, so that later blocks stay resident when freed and a run's peak depended on what ran
before it (SDPA at 1K read 175 MiB after a 2K run, 85 MiB before it; 74 with the threshold fixed).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
from pathlib import Path

import torch

from d2o.errors import D2OError

_PROC = Path("/proc/self")


def cache_bytes(cache) -> int:
    """Bytes a cache holds: d2o's its keys, values and their slots' bookkeeping (``nbytes``), the
    stock cache its keys and values."""
    if hasattr(cache, "nbytes"):
        return cache.nbytes
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None)


def measure_peak(fn, device: torch.device | str):
    """``(fn(), peak)``: the peak bytes held while ``fn`` ran beyond what was held when it started,
    on ``device`` (where ``fn`` computes: a CPU run on a machine with a GPU is measured on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = fn()
        torch.cuda.synchronize(device)
        return result, torch.cuda.max_memory_allocated(device) - before
    if not (_PROC / "clear_refs").exists():
        raise D2OError("peak CPU memory is read from /proc/self (Linux only); run the benchmark on Linux or a GPU")
    _fix_heap()
    (_PROC / "clear_refs").write_text("5")  # the high-water mark restarts from the resident size now
    before = _status_bytes("VmRSS")
    result = fn()
    return result, max(0, _status_bytes("VmHWM") - before)


def _status_bytes(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", (_PROC / "status").read_text(), re.MULTILINE)
    return int(match.group(1)) * 1024


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 128 * 1024  # glibc's initial value: blocks from 128 KiB on are mapped, and unmapped when freed


def _fix_heap() -> None:
    """Hand freed heap back to the kernel and keep large blocks in their own mappings (glibc)."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim"):  # glibc; others differ
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)  # setting it turns the threshold's rise off
        libc.malloc_trim(0)
