"""Asserting that a path ran: count the calls of the function it is made of."""

from __future__ import annotations

import pytest


def calls_of(monkeypatch: pytest.MonkeyPatch, owner, name: str) -> list:
    """Replace `owner.name` (a module-level function, or a method on a class) by a wrapper that records each call
    and calls through; returns the list the calls are appended to."""
    real = getattr(owner, name)
    seen: list = []

    def spy(*args, **kwargs):
        seen.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return seen
