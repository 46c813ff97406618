"""Where the quickstart's time and memory go: CPU seconds, wall seconds and peak RSS per stage.

    OMP_NUM_THREADS=2 python benchmarks/quickstart_profile.py --out /tmp/qs-profile [--json profile.json] [--device cuda]

Runs `moembed quickstart` in this process with the default recipe (or `--config FILE`), wrapping each stage to
record its wall time, the process's user + system CPU time, and the peak resident set size reached *during* the
stage (a sampling thread reads /proc/self/statm every 50 ms, since ru_maxrss only ever grows). The run starts
from an empty `--out` so no stage is skipped, with the allocator settings of the `moembed` command
(moembed.heap). Prints one JSON object and, with `--json`, writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

from moembed.heap import configure_process, start_on_mimalloc

PAGE = os.sysconf("SC_PAGE_SIZE")


class RssSampler:
    """Peak resident set size (MiB) between `reset()` calls, sampled from /proc/self/statm."""

    def __init__(self, period: float = 0.05):
        self.period, self.peak, self._stop = period, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _rss(self) -> float:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * PAGE / 2**20

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.peak = max(self.peak, self._rss())

    def reset(self) -> None:
        self.peak = self._rss()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="quickstart work directory (emptied first)")
    ap.add_argument("--config", type=Path, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--preset", default=None, help="english (default) | multilingual")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--device", default=None, help="auto | cpu | cuda | mps (default: the recipe's, auto)")
    args = ap.parse_args()
    start_on_mimalloc([__file__, *sys.argv[1:]])  # the command's allocator (MOEMBED_ALLOCATOR=system: glibc's)
    configure_process(training=True)  # the process settings `moembed quickstart` runs with, before torch loads
    from moembed.recipes.quickstart import Quickstart, load_quickstart_config

    if args.out.exists():
        shutil.rmtree(args.out)
    sampler = RssSampler()
    stages: dict[str, dict] = {}
    original = Quickstart.run_stage

    def profiled(self, name, fn, n, total):
        sampler.reset()
        t0, c0 = time.perf_counter(), os.times()
        result = original(self, name, fn, n, total)
        c1 = os.times()
        stages[name] = {
            "wall_s": round(time.perf_counter() - t0, 1),
            "cpu_s": round((c1.user - c0.user) + (c1.system - c0.system), 1),
            "peak_rss_mib": round(sampler.peak),
        }
        print(name, json.dumps(stages[name]), flush=True)
        return result

    Quickstart.run_stage = profiled
    cfg = load_quickstart_config(args.config, args.preset, steps=args.steps, device=args.device)
    t0, c0 = time.perf_counter(), os.times()
    Quickstart(cfg, args.out, progress=False, owns_process=True).run()  # as `moembed quickstart` runs it
    c1 = os.times()
    sampler.stop()
    import resource

    report = {
        "stages": stages,
        "total": {"wall_s": round(time.perf_counter() - t0, 1),
                  "cpu_s": round((c1.user - c0.user) + (c1.system - c0.system), 1),
                  "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)},
        "scores": json.loads((args.out / "stages" / "report.json").read_text()).get("summary"),
    }
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
