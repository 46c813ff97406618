"""What every stage of the quickstart recipe reads: its settings, where it works, and the models it starts from.

    RecipeContext(cfg, out, base, ...)   the settings resolved once before any work (`quickstart.open_context`:
                                         the base model converted on first use and loaded once, so that one that does
                                         not load is refused up front; the teacher; the device)
    ctx.stage_result(name)               what a finished stage left in OUT/stages/<name>.json

The context is frozen: a stage reads it and returns its own result (a dict, stored by the runner), so what one
stage hands the next is on disk, where a rerun finds it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moembed.recipes.config import QuickstartConfig


@dataclass(frozen=True)
class RecipeContext:
    """One quickstart run's settings and places.

    cfg            the validated settings (moembed.recipes.config)
    out            the work and report directory
    base, teacher  model directories (the teacher is the base unless `teacher` is set)
    base_name      the base's name in model names and the report ("minilm", "multilingual-e5-small", a dir's name)
    width          the base model's embedding width
    device         where the teacher, training and evaluation run
    progress       progress bars on
    owns_process   the run owns its process (`moembed quickstart`): training stages run under
                   moembed.heap.bounded_heap, which sets glibc's allocator policy for the whole process; a library
                   caller's process keeps its own
    """

    cfg: QuickstartConfig
    out: Path
    base: Path
    base_name: str
    width: int
    teacher: Path
    device: torch.device
    progress: bool = True
    owns_process: bool = False
    matryoshka_dims: list[int] = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "matryoshka_dims", self.cfg.train.dims(self.width))

    @property
    def stages(self) -> Path:
        """OUT/stages: one JSON file per finished stage."""
        return self.out / "stages"

    def stage_result(self, name: str) -> dict:
        return json.loads((self.stages / f"{name}.json").read_text())
