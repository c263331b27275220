"""Learning rate over the RL steps: `lr_at(step, steps, lr, schedule, warmup_steps)`.

Step s = 1 .. steps (the update of RL step s). The first `warmup_steps` steps rise linearly to `lr`
(s / warmup_steps of it); after them, with progress p = (s - warmup_steps - 1) / (steps - warmup_steps)
in [0, 1):
    constant: lr
    linear:   lr * (1 - p)
    cosine:   lr * (1 + cos(pi * p)) / 2
so no step trains at a learning rate of 0 (the decay would reach 0 one step past the last).
"""

import math

SCHEDULES = ("constant", "linear", "cosine")


def lr_at(step: int, steps: int, lr: float, schedule: str = "constant", warmup_steps: int = 0) -> float:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}; choose one of {list(SCHEDULES)}")
    if step < 1:
        raise ValueError(f"step={step} must be >= 1")
    if step <= warmup_steps:
        return lr * step / warmup_steps
    if schedule == "constant":
        return lr
    p = (step - warmup_steps - 1) / max(steps - warmup_steps, 1)
    p = min(p, 1.0)
    if schedule == "linear":
        return lr * (1 - p)
    return lr * (1 + math.cos(math.pi * p)) / 2
