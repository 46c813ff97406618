"""Progress reporting for long loops: a callback `(done, total) -> None` and a terminal bar that feeds on it.

Library loops (moembed.model.inference and its callers) take a `Progress` callback and never draw anything
themselves; whoever wants a bar passes `bar(...)`'s callback.

    >>> with bar("encode", unit="text") as progress:
    ...     embedder.embed_tensor(texts, progress=progress)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

# Called after each batch with the number of items done so far and the total.
Progress = Callable[[int, int], None]


@contextlib.contextmanager
def bar(desc: str, unit: str = "text", enabled: bool = True, leave: bool = False) -> Iterator[Progress | None]:
    """A tqdm bar as a `Progress` callback (None when not enabled), closed on exit."""
    if not enabled:
        yield None
        return
    from tqdm.auto import tqdm

    t = tqdm(desc=desc, unit=unit, leave=leave)

    def update(done: int, total: int) -> None:
        t.total = total
        t.update(done - t.n)

    try:
        yield update
    finally:
        t.close()
