"""Peak resident memory of this process over a span of work (a recipe stage, a training run).

`ru_maxrss` only ever grows, so after a stage that peaked high every later stage would report that peak. Linux
keeps the same high-water mark as `VmHWM` in /proc/self/status and resets it to the current resident size when
"5" is written to /proc/self/clear_refs (proc(5)); the span's own peak is then VmHWM at its end. Where that file
cannot be written (not Linux, a restricted /proc), the peak is the process's peak since it started, and
`PeakRss.scope` says so.

    with PeakRss() as peak:
        run_stage()
    peak.mib, peak.scope      # e.g. 3712, "span"  ("process": the peak since the process started)
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

_STATUS, _CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def reset_peak_rss() -> bool:
    """Reset the kernel's high-water mark of this process to its current resident size; whether it could."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def peak_rss_mib() -> int:
    """The high-water mark of this process's resident memory in MiB: since the last `reset_peak_rss`, or since the
    process started where there is no /proc/self/status."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024)  # kB
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB elsewhere
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20)


class PeakRss:
    """A context whose `mib` is the peak resident memory reached inside it; `scope` is "span" when the kernel's
    mark was reset at its start, "process" when it holds the peak since the process started."""

    def __init__(self):
        self.mib: int | None = None
        self.scope = "span"

    def __enter__(self) -> PeakRss:
        self.scope = "span" if reset_peak_rss() else "process"
        return self

    def __exit__(self, *exc) -> None:
        self.mib = peak_rss_mib()
