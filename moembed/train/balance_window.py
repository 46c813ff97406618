"""The routing counts of the last steps, for load balancing over more than one step's batch.

nomic-embed-v2 Eq. 1 counts r_i, each expert's share of the routing assignments, over one step's batch. The
recipes draw one source (one language or language pair) per batch, as nomic-embed-v2 §4 does, so a router that sends
each language to its own experts is maximally unbalanced within every batch and the loss pushes it back to
uniform, even when the load over the sources together is even. Qiu et al. 2025 ("Demons in the Detail: On
Implementing Load Balancing Loss for Training Specialized Mixture-of-Expert Models", arXiv 2501.11873) count r over
the global batch instead of each micro-batch and find more specialised experts and a lower loss; a step here is one
source whatever its size, so the window extends the count over the last W steps (`LossConfig.balance_window`).
p_i stays this step's: only the fractions come from the window.
"""

from __future__ import annotations

from collections import deque

import torch


class RoutingWindow:
    """The global routing counts (L, E) of up to W − 1 earlier steps; W = 1 keeps none (the per-step loss).

    The counts pushed are those of every rank (`step.global_routing` sums them), so every rank holds the same
    window and rank 0's copy in a checkpoint restores all of them.
    """

    def __init__(self, steps: int):
        self.counts: deque[torch.Tensor] = deque(maxlen=steps - 1)  # appending beyond W − 1 drops the oldest

    def history(self) -> torch.Tensor | None:
        """(L, E) assignments of the earlier steps in the window, summed; None when there are none."""
        if not self.counts:
            return None
        return torch.stack(list(self.counts)).sum(0)

    def push(self, counts: torch.Tensor | None) -> None:
        """Add one step's (L, E) counts of all ranks (None: a dense model, nothing routed)."""
        if counts is not None:
            self.counts.append(counts.detach().to("cpu", torch.float64))

    def state(self) -> list:
        """JSON-serialisable: the earlier steps' counts, oldest first."""
        return [c.tolist() for c in self.counts]

    def load_state(self, state: list) -> None:
        self.counts.clear()
        self.counts.extend(torch.tensor(c, dtype=torch.float64) for c in state)
