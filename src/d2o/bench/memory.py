"""Peak memory of a piece of code: the GPU allocator's peak, or on the CPU the process's peak
resident memory (reset before the code runs) and the profiler's allocation events."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

STATUS = Path("/proc/self/status")


def peak_process_bytes(fn, device: torch.device) -> int:
    """Peak bytes held while ``fn()`` runs beyond what was held before: the CUDA allocator's
    peak, or the process's resident set (its high-water mark reset first; Linux)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    before = _status_bytes("VmRSS")
    fn()
    return _status_bytes("VmHWM") - before


def _status_bytes(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", STATUS.read_text(), re.MULTILINE)
    return int(match.group(1)) * 1024


def peak_allocated_bytes(fn) -> int:
    """Peak of the bytes held by tensors allocated while ``fn()`` runs (beyond what existed before)."""
    if torch.cuda.is_available():
        return peak_process_bytes(fn, torch.device("cuda"))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    handle, path = tempfile.mkstemp(suffix=".json")
    os.close(handle)
    try:
        prof.export_chrome_trace(path)
        with open(path) as stream:
            events = json.load(stream)["traceEvents"]
    finally:
        os.remove(path)
    memory = [e["args"] for e in events if e.get("name") == "[memory]"]
    if not memory:
        return 0
    baseline = memory[0]["Total Allocated"] - memory[0]["Bytes"]
    return max(m["Total Allocated"] for m in memory) - baseline
