"""Whether weights changed: what the caches keyed by weights (casts, packed and int8 copies, `weights_key`) look at.

A tensor's `_version` counts the in-place updates autograd sees, and `data_ptr()` moves when a tensor is replaced,
but a fused optimizer's updates are in neither: torch's fused AdamW (the trainer's, `train/optim.py`) writes every
weight from one kernel and leaves the version counters as they were. A cache keyed by versions alone would then
serve the weights of step 1 to every later step. So those caches also key on `optimizer_steps()`, the number of
optimizer steps this process has taken, counted by a hook torch calls after every optimizer's `step`.
"""

from __future__ import annotations

from torch.optim.optimizer import register_optimizer_step_post_hook

_steps = 0


def _count(optimizer, args, kwargs) -> None:
    global _steps
    _steps += 1


register_optimizer_step_post_hook(_count)


def optimizer_steps() -> int:
    """Optimizer steps taken in this process so far (by any torch optimizer)."""
    return _steps
