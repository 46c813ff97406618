"""One source per batch: a batch never mixes data sources (nomic-embed-v1 §4.2.2; arctic-embed-2 App. C).

The source of each batch is drawn at random with

    p_i = (w_i · n_i)^(1/T) / Σ_j (w_j · n_j)^(1/T)

where n_i is the number of records of source i, w_i its `weight` (default 1) and T the sampler temperature.
T = 1 samples proportionally to size (every record is seen about once per epoch); T > 1 flattens the mix
towards small sources; T → ∞ is uniform over sources. For MLM language sampling (Nomic v2 Table 2, α = 0.3),
p_i ∝ n_i^α, i.e. T = 1/α. Each language of a multilingual source can be its own source (arctic-embed-2 App. C).

Everything is deterministic from the seed, and `state()` (the generator state plus every reader's position)
is plain JSON that goes into the checkpoint, so a resumed run draws exactly the batches it would have drawn.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moembed.data.sources import Example, PairSource, SourceStats


def source_probabilities(sizes: list[int], weights: list[float] | None = None, temperature: float = 1.0) -> np.ndarray:
    """p_i = (w_i · n_i)^(1/T) / Σ_j (w_j · n_j)^(1/T), computed in log space (sizes can be billions)."""
    n = np.asarray(sizes, dtype=np.float64)
    w = np.ones_like(n) if weights is None else np.asarray(weights, dtype=np.float64)
    logits = np.log(w * n) / temperature
    p = np.exp(logits - logits.max())
    return p / p.sum()


class SourceSampler:
    """Draws a source index per batch with `source_probabilities`; its state is JSON-serialisable."""

    def __init__(self, sizes: list[int], weights: list[float] | None = None, temperature: float = 1.0, seed: int = 0):
        self.probs = source_probabilities(sizes, weights, temperature)
        self.rng = np.random.Generator(np.random.PCG64(seed))

    def next(self) -> int:
        return int(self.rng.choice(len(self.probs), p=self.probs))

    def state(self) -> dict:
        return self.rng.bit_generator.state

    def load_state(self, s: dict) -> None:
        self.rng.bit_generator.state = s


@dataclass
class PairBatch:
    source: str
    queries: list[str]  # (B,)
    documents: list[str]  # (B,)
    negatives: list[str] | None  # (B·H,) query i's negatives at [i·H, (i+1)·H), or None when H = 0


class PairBatchStream:
    """Batches of (query, document, H hard negatives) from one source each.

    H negatives per query are drawn at random without replacement from its mined list (nomic-embed-v1 §4.2.5:
    random rather than the top ones, since the top of the list holds more false negatives); a list shorter
    than H is sampled with replacement; a record with no negatives at all is dropped and counted when H > 0.
    `batch_size` is the global batch; with several ranks every rank draws the same global batch and keeps
    its own slice, so the data order does not depend on the number of processes.
    """

    def __init__(self, sources: list[PairSource], batch_size: int, num_negatives: int, temperature: float,
                 seed: int, stats: SourceStats, rank: int = 0, world_size: int = 1):
        if batch_size % world_size:
            raise ValueError(f"batch_size ({batch_size}) must be divisible by the number of processes ({world_size})")
        self.sources, self.batch_size, self.H, self.stats = sources, batch_size, num_negatives, stats
        self.rank, self.world = rank, world_size
        self.sampler = SourceSampler([s.size for s in sources], [s.cfg.weight for s in sources], temperature, seed)
        self.neg_rng = np.random.Generator(np.random.PCG64(seed + 1))

    def _draw_negatives(self, ex: Example) -> list[str]:
        k = len(ex.negatives)
        idx = self.neg_rng.choice(k, size=self.H, replace=k < self.H)
        return [ex.negatives[i] for i in idx]

    def next(self) -> PairBatch:
        src = self.sources[self.sampler.next()]
        examples: list[Example] = []
        while len(examples) < self.batch_size:
            ex = src.next()
            if self.H and not ex.negatives:
                self.stats.no_negatives[src.name] += 1
                continue
            examples.append(ex)
        per = self.batch_size // self.world
        mine = examples[self.rank * per : (self.rank + 1) * per]
        negs = None
        if self.H:
            # Drawn for the whole global batch on every rank so the generator stays in step across ranks.
            all_negs = [self._draw_negatives(ex) for ex in examples]
            negs = [n for lst in all_negs[self.rank * per : (self.rank + 1) * per] for n in lst]
        return PairBatch(src.name, [e.query for e in mine], [e.document for e in mine], negs)

    def state(self) -> dict:
        return {
            "sampler": self.sampler.state(),
            "negatives": self.neg_rng.bit_generator.state,
            "sources": {s.name: s.state() for s in self.sources},
            "stats": self.stats.as_dict(),
        }

    def load_state(self, s: dict) -> None:
        self.sampler.load_state(s["sampler"])
        self.neg_rng.bit_generator.state = s["negatives"]
        for src in self.sources:
            if src.name in s["sources"]:
                src.load_state(s["sources"][src.name])
        for k, v in s.get("stats", {}).items():
            getattr(self.stats, k).clear()
            getattr(self.stats, k).update(v)
