"""The clock for durations of device work: read once the device has finished what was queued.

CUDA kernels run asynchronously, so perf_counter around a forward measures its launches; every
duration that feeds a decision (the speculative step-cost table, draft pass costs, the engine's
busy time the autoscaler reads) reads this clock instead. On CPU it is perf_counter.
"""
from __future__ import annotations

import time

import torch


def device_clock(device: torch.device) -> float:
    """perf_counter after the device has run all queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
