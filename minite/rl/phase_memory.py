"""Peak device memory of each phase of an RL step (rollout, learner), for the step's metrics.

On CUDA, `PhaseMemory(device)` resets the allocator's peak counter; `end(phase)` records the peak
allocated since the last reset as `memory/{phase}_peak_gb` and resets again, so each phase's peak is
its own. Elsewhere it records nothing.
"""

from __future__ import annotations

import torch

GB = 1e9


class PhaseMemory:
    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.device = device
        self.metrics: dict[str, float] = {}
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)

    def end(self, phase: str) -> None:
        if not self.cuda:
            return
        self.metrics[f"memory/{phase}_peak_gb"] = torch.cuda.max_memory_allocated(self.device) / GB
        torch.cuda.reset_peak_memory_stats(self.device)
