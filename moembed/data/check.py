"""Training data checked before training: every record of every source, streamed, in one pass.

    report = check_data(cfg.data, text=False, skip_bad=False)   # raises before step 1, listing what is wrong

A run that meets a bad record at step 500 has spent its time for nothing (and written checkpoints of a run that
cannot finish); a short run may never read it at all. So `moembed validate`, `moembed train` (before its first
step) and `moembed quickstart --data` read every record once, with the decoding and parsing training uses
(`moembed.data.sources`: the readers' `scan`, `PairSource.parse`, `TextSource.parse`), so that they find exactly
the records training would stop at: not UTF-8, not JSON, a lone surrogate, not an object, a missing field, a field
of the wrong type. All of them are reported, the first `MAX_LISTED` by `file:line` (Parquet and `datasets`:
`file:row N`) and the rest as a count; with `skip_bad` they are counted and skipped instead. Records with an empty
query, document or text are counted (training drops them); a source with no usable record is an error.

Memory: one block of raw records per reader (as training). Time: about a JSON parse per record (BENCHMARKS.md,
"Training data checked before step 1").
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from moembed.data.config import SourceConfig
from moembed.data.sources import BadRecord, PairSource, TextSource, open_reader
from moembed.errors import MoembedError

log = logging.getLogger("moembed")

MAX_LISTED = 20  # bad records named one by one; the others are counted


@dataclass
class SourceCheck:
    label: str
    path: str
    records: int = 0  # all records, bad ones included
    bad: int = 0
    empty: int = 0

    @property
    def usable(self) -> int:
        return self.records - self.bad - self.empty


@dataclass
class DataCheck:
    sources: list[SourceCheck] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # the first MAX_LISTED bad records, "file:line: what"
    seconds: float = 0.0

    @property
    def records(self) -> int:
        return sum(s.records for s in self.sources)

    @property
    def bad(self) -> int:
        return sum(s.bad for s in self.sources)

    @property
    def empty(self) -> int:
        return sum(s.empty for s in self.sources)

    def summary(self) -> str:
        return (f"{self.records} records in {len(self.sources)} source(s) checked in {self.seconds:.1f} s: "
                f"{self.bad} malformed, {self.empty} empty")

    def listing(self) -> str:
        return listing(self.errors, self.bad)


def listing(errors: list[str], total: int) -> str:
    """The listed errors one per indented line, and how many more there are: the tail of an error message."""
    more = f"\n  ... and {total - len(errors)} more" if total > len(errors) else ""
    return "".join(f"\n  {e}" for e in errors) + more


def scan_sources(sources: list[SourceConfig], text: bool = False, max_listed: int = MAX_LISTED) -> DataCheck:
    """Read every record of every source once; count records, malformed and empty ones, keep the first
    `max_listed` errors. `text`: records are MLM text (TextSource), else pairs (PairSource)."""
    kind = TextSource if text else PairSource
    report, t0 = DataCheck(), time.perf_counter()
    for cfg in sources:
        s = SourceCheck(cfg.label, cfg.path)
        report.sources.append(s)

        def bad(message: str, s: SourceCheck = s) -> None:
            s.bad += 1
            if len(report.errors) < max_listed:
                report.errors.append(message)

        def undecodable(message: str, s: SourceCheck = s) -> None:
            s.records += 1
            bad(message)

        parse = kind.parse
        for where, value in open_reader(cfg, kind.columns(cfg)).scan(undecodable):
            s.records += 1
            try:
                if parse(cfg, value, where) is None:
                    s.empty += 1
            except BadRecord as e:
                bad(str(e))
    report.seconds = time.perf_counter() - t0
    return report


def check_data(sources: list[SourceConfig], text: bool = False, skip_bad: bool = False) -> DataCheck:
    """`scan_sources`, then: malformed records raise one MoembedError listing them (with `skip_bad`: a log line
    says how many will be skipped); a source with no records, or none usable, raises; empty records are logged."""
    report = scan_sources(sources, text)
    for s in report.sources:
        if s.records == 0:
            raise MoembedError(f"{s.path}: no records (data source {s.label!r})")
    if report.bad and not skip_bad:
        raise MoembedError(f"training data: {report.bad} malformed record(s) of {report.records}, found before "
                           f"training; fix them, or set skip_bad: true to skip and count them:{report.listing()}")
    for s in report.sources:
        if s.usable <= 0:
            raise MoembedError(f"{s.path}: no usable records ({s.records} records: {s.bad} malformed, {s.empty} "
                               f"empty; data source {s.label!r})")
    log.info("training data: %s", report.summary())
    if report.bad:
        log.warning("skip_bad: %d malformed record(s) will be skipped:%s", report.bad, report.listing())
    return report
