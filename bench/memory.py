"""Peak resident memory of a set of process groups, sampled in a thread (psutil).

RSS summed over processes counts shared pages (libraries, torch) once per
process: it is the conservative figure. PSS (proportional set size) splits
shared pages between their users, so its sum is what the processes really
occupy together; it is costlier to read and sampled less often.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import psutil

from pdstack.supervisor import Record

RSS_INTERVAL_S = 0.5
PSS_INTERVAL_S = 5.0


def _sum(
    groups: Mapping[str, Sequence[Record]], read: Callable[[psutil.Process], int]
) -> dict[str, int]:
    out = dict.fromkeys(groups, 0)
    for name, records in groups.items():
        # The whole process group: also an engine core whose server died.
        for proc in (p for record in records for p in record.members()):
            with contextlib.suppress(psutil.Error):
                out[name] += read(proc)
    return out


@dataclass
class Peak:
    rss_total: int = 0
    rss_by_group: dict[str, int] = field(default_factory=dict)
    pss_total: int = 0
    pss_by_group: dict[str, int] = field(default_factory=dict)
    samples: int = 0


class PeakMemory:
    """``with PeakMemory({"prefill": [record], ...}) as m: ...; m.peak``
    (records: ``pdstack.supervisor.Record``)."""

    def __init__(self, groups: Mapping[str, Sequence[Record]]) -> None:
        self.groups = dict(groups)
        self.peak = Peak()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="memory")

    def sample(self, with_pss: bool) -> None:
        rss = _sum(self.groups, lambda p: p.memory_info().rss)
        self.peak.samples += 1
        if (total := sum(rss.values())) > self.peak.rss_total:
            self.peak.rss_total, self.peak.rss_by_group = total, rss
        if with_pss:
            pss = _sum(self.groups, lambda p: p.memory_full_info().pss)
            if (total := sum(pss.values())) > self.peak.pss_total:
                self.peak.pss_total, self.peak.pss_by_group = total, pss

    def _run(self) -> None:
        last_pss = 0.0
        while not self._stop.is_set():
            if with_pss := time.monotonic() - last_pss >= PSS_INTERVAL_S:
                last_pss = time.monotonic()
            self.sample(with_pss)
            self._stop.wait(RSS_INTERVAL_S)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.sample(with_pss=True)
