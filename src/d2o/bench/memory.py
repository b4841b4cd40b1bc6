"""Peak memory of a piece of torch code: the GPU allocator's peak, or on the CPU the peak of the
bytes held by tensors, from the profiler's allocation events."""

from __future__ import annotations

import json
import os
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile


def peak_allocated_bytes(fn) -> int:
    """Peak of the bytes held by tensors allocated while ``fn()`` runs (beyond what existed before)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
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
