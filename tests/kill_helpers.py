"""SIGKILL at reproducible instants: a process kills itself at the k-th interpreter event (a Python or C function
call or return, counted by `sys.setprofile`) after a chosen point, so a seeded k lands anywhere inside a save,
including between the two renames of a directory swap, and the same seed always kills at the same instant.

Used in forked children (`run_forked`) and, through `python kill_helpers.py train ...`, in a training subprocess.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
from collections.abc import Callable
from contextlib import contextmanager


class Killer:
    """Count events while `active`; SIGKILL this process at event `k` after `anchor` was entered: a Python function
    (by name) or a builtin (the object itself, e.g. os.replace), or from the first activation when `anchor` is None.
    k = -1 never kills (counts only, for dry runs)."""

    def __init__(self, k: int = -1, anchor: str | Callable | None = None):
        self.k, self.anchor = k, anchor
        self.armed = anchor is None
        self.n = 0

    def _profile(self, frame, event, arg):
        if not self.armed:
            if (event == "call" and frame.f_code.co_name == self.anchor) or (event == "c_call" and arg is self.anchor):
                self.armed = True
            else:
                return
        self.n += 1
        if self.n == self.k:
            os.kill(os.getpid(), signal.SIGKILL)

    @contextmanager
    def active(self):
        sys.setprofile(self._profile)
        try:
            yield self
        finally:
            sys.setprofile(None)


def run_forked(fn: Callable, *args) -> int:
    """Run fn(*args) in a forked child with one torch thread; its exit code (-9 when it killed itself)."""
    proc = mp.get_context("fork").Process(target=_child, args=(fn, args))
    proc.start()
    proc.join(120)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        raise AssertionError("the child did not finish in 120 s")
    return proc.exitcode


def _child(fn, args):
    import torch

    torch.set_num_threads(1)
    fn(*args)


def train_killed_at(step: int, anchor: str | None, k: int, argv: list[str]) -> None:
    """Run the `moembed` CLI; SIGKILL at event k after `anchor` within the checkpoint save of `step`."""
    from moembed.cli.main import main
    from moembed.train.checkpoint import CheckpointManager

    real = CheckpointManager.save

    def save(self, s, *a, **kw):
        if s != step:
            return real(self, s, *a, **kw)
        killer = Killer(k, anchor)
        with killer.active():
            out = real(self, s, *a, **kw)
        print(f"save of step {s}: {killer.n} events after the anchor, no kill", file=sys.stderr)
        return out

    CheckpointManager.save = save
    sys.argv = ["moembed", *argv]
    main()


if __name__ == "__main__" and sys.argv[1] == "train":  # python kill_helpers.py train STEP ANCHOR|- K ARGS...
    train_killed_at(int(sys.argv[2]), None if sys.argv[3] == "-" else sys.argv[3], int(sys.argv[4]), sys.argv[5:])
