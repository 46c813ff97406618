"""Atomic, resumable training checkpoints.

A checkpoint is a directory `<dir>/step-00001234/` written under a temporary name, fsynced and renamed into place
(`moembed.fileio.atomic_dir`); old ones are deleted atomically too. A run killed at any moment leaves only complete
checkpoints behind, and a full disk during a save raises a MoembedError with the earlier checkpoints intact:

    model.safetensors   the trained module's weights (tied weights stored once)
    optimizer.pt        optimizer state_dict
    rng.pt              scheduler state and the torch / numpy / python RNG states, as tensors and plain types
    state.json          step, data position (sampler and reader state) and run metadata

Everything is read back with safetensors or `torch.load(weights_only=True)`; no pickled objects.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_model, save_model
from torch import nn

from moembed.errors import MoembedError
from moembed.fileio import atomic_dir, recover_dir, remove_dir

_NAME = re.compile(r"^step-(\d{8})$")


def rng_state() -> dict:
    """The global RNG states as weights_only-loadable values."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(keys.astype(np.int64)),
        "numpy_meta": [kind, int(pos), int(has_gauss), float(cached)],
        "python": torch.tensor(internal, dtype=torch.int64),
        "python_meta": [int(version), gauss],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    kind, pos, has_gauss, cached = state["numpy_meta"]
    np.random.set_state((kind, state["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached))
    version, gauss = state["python_meta"]
    random.setstate((version, tuple(int(x) for x in state["python"].tolist()), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class Resumed:
    step: int
    data_state: dict
    path: Path
    meta: dict


class CheckpointManager:
    """Save, list, prune and restore checkpoints in one directory."""

    def __init__(self, directory: str | Path, keep_last: int = 2):
        self.dir = Path(directory)
        self.keep_last = keep_last

    def all(self) -> list[Path]:
        """Complete checkpoints, oldest first (temporary directories are ignored)."""
        if not self.dir.is_dir():
            return []
        found = [p for p in self.dir.iterdir() if p.is_dir() and _NAME.match(p.name)]
        return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))

    def latest(self) -> Path | None:
        found = self.all()
        return found[-1] if found else None

    def path(self, step: int) -> Path:
        """The directory of the checkpoint after `step` steps."""
        return self.dir / f"step-{step:08d}"

    def save(self, step: int, model: nn.Module, optimizer, scheduler, data_state: dict, meta: dict | None = None,
             rng_states: list[dict] | None = None) -> Path:
        """Write step-<step>/ atomically; `rng_states` holds one entry per rank (default: this process's)."""
        target = self.path(step)
        with atomic_dir(target) as tmp:
            save_model(model, str(tmp / "model.safetensors"))
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
            torch.save({"scheduler": scheduler.state_dict(), "rng": rng_states or [rng_state()]}, tmp / "rng.pt")
            state = {"step": step, "data": data_state, "meta": meta or {}}
            (tmp / "state.json").write_text(json.dumps(state), encoding="utf-8")
        self._prune()
        return target

    def _prune(self) -> None:
        """Delete all but the last `keep_last` checkpoints, each atomically (never a half-deleted `step-*`), and the
        hidden leftovers of saves or deletions that a kill interrupted (one trainer writes a checkpoint directory)."""
        for old in self.all()[: -self.keep_last]:
            remove_dir(old)
        for p in self.dir.iterdir():
            if p.name.startswith(".step-") and p.name.endswith(".old"):
                recover_dir(self.dir / p.name[1:-4])  # an interrupted replacement: restored or dropped
            elif p.name.startswith(".step-") and p.name.endswith(".tmp"):
                shutil.rmtree(p, ignore_errors=True)

    def load(self, path: Path, model: nn.Module, optimizer, scheduler, rank: int = 0) -> Resumed:
        """Restore everything saved by `save` into the given objects; returns the step and data position."""
        try:
            missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False)
            if missing or unexpected:
                raise MoembedError(
                    f"{path / 'model.safetensors'}: does not match the model "
                    f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})"
                )
            optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True))
            extra = torch.load(path / "rng.pt", map_location="cpu", weights_only=True)
            state = json.loads((path / "state.json").read_text(encoding="utf-8"))
        except MoembedError:
            raise
        except (OSError, RuntimeError, ValueError, KeyError) as e:
            raise MoembedError(f"{path}: cannot restore checkpoint ({type(e).__name__}: {str(e)[:200]})") from None
        scheduler.load_state_dict(extra["scheduler"])
        rngs = extra["rng"]
        set_rng_state(rngs[rank] if rank < len(rngs) else rngs[0])
        return Resumed(step=int(state["step"]), data_state=state["data"], path=path, meta=state.get("meta") or {})
