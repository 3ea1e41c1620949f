"""Read profiler timelines (nsys SQLite exports, torch.profiler Chrome traces) and compare them per NVTX range.

A timeline is reduced to three lists, all times in integer nanoseconds:

- **ranges**: named CPU ranges (NVTX push/pop or start/end ranges; ``record_function`` ranges,
  which a Chrome trace files under ``cat == "user_annotation"``), each on one CPU thread;
- **launches**: CPU calls that put work on the device (``cudaLaunchKernel``, ``cudaGraphLaunch``...);
- **device work**: what ran on the device (kernels), each tied to the CPU thread and time of the
  launch that issued it (CUDA correlation id).

Work belongs to a range when its launch happened on the range's thread inside the range: device
execution is asynchronous, so a kernel may *run* after its range has closed, but it is the work
*issued* by that range. Per range instance:

- ``gpu_time``: the union of its work's device intervals (busy time; overlapping streams count once);
- ``kernels``: how many kernels it issued; ``launches``: how many launch calls it made (one graph
  launch issues many kernels, so graphs show as kernels >> launches);
- ``launch_gap``: CPU time between consecutive launch calls (end of one to start of the next), the
  host overhead that the device may be waiting on;
- ``idle``: within the window from its first kernel's start to its last kernel's end, the time the
  device was not running its work.

Ranges with the same name are aggregated: every figure is summed and ``count`` is the number of
instances. **CPU-only Chrome traces** have no device timeline; there the CPU *is* the device: each
top-level operator (a ``cpu_op`` not nested in another ``cpu_op`` on its thread) counts as one
kernel and as its own launch, ``gpu_time`` is the union of those operators' intervals, and
``idle``/``launch_gap`` are the time between them (Python and framework overhead).

nsys SQLite schema relied on (``nsys export --type sqlite``; tables are created lazily):
``StringIds(id, value)``; ``NVTX_EVENTS(start, end, eventType, text, textId, globalTid, ...)`` with
``eventType`` 59 = push/pop range, 60 = start/end range, the name in ``text`` or, for registered
strings, ``StringIds[textId]``; ``CUPTI_ACTIVITY_KIND_KERNEL(start, end, correlationId,
globalPid, ...)``; ``CUPTI_ACTIVITY_KIND_RUNTIME(start, end, globalTid, correlationId, nameId)``,
whose ``correlationId`` matches the kernels it launched. ``globalTid`` serialises the process id
in bits 24..47, so ``globalTid >> 24`` names the process on both sides of the join.
"""

from __future__ import annotations

import bisect
import gzip
import json
import sqlite3
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Hashable, Iterable

from mhc_cg.core.errors import ConfigError

NS_PER_MS = 1_000_000
NSYS_PUSH_POP_RANGE = 59
NSYS_START_END_RANGE = 60
SQLITE_MAGIC = b"SQLite format 3\x00"
GZIP_MAGIC = b"\x1f\x8b"

KIND_NSYS = "nsys"
KIND_CHROME_GPU = "chrome-gpu"
KIND_CHROME_CPU = "chrome-cpu"
GPU_TIME_MEANING = {
    KIND_NSYS: "GPU time = union of kernel intervals on the GPU (nsys CUPTI kernels), "
               "attributed to the range whose thread launched them",
    KIND_CHROME_GPU: "GPU time = union of kernel intervals on the GPU (torch.profiler CUDA kernels), "
                     "attributed to the range whose thread launched them",
    KIND_CHROME_CPU: "no device in this trace: GPU time = union of top-level CPU operator intervals "
                     "(the CPU is the device), kernels = launches = top-level CPU operators",
}


class TraceReadError(ConfigError):
    """A file that is not a readable nsys SQLite export or Chrome trace; says what was expected."""


@dataclass(frozen=True)
class RangeEvent:
    name: str
    start: int
    end: int
    thread: Hashable


@dataclass(frozen=True)
class LaunchCall:
    start: int
    end: int
    thread: Hashable


@dataclass(frozen=True)
class DeviceWork:
    start: int
    end: int
    launch_thread: Hashable | None  # None: no launch call found (not attributable to a range)
    launch_time: int
    name: str = ""  # the kernel's (Chrome traces of a GPU run)


@dataclass
class Timeline:
    """One profile, reduced to named ranges, launch calls and device work (times in ns)."""

    path: Path
    kind: str
    ranges: list[RangeEvent]
    launches: list[LaunchCall]
    work: list[DeviceWork]
    # CPU-only traces: every operator ``(start, end, thread)``, nested ones included, so that a range
    # opened inside an operator (a recompute hook inside an autograd node) still sees its own work
    cpu_ops: list[tuple[int, int, Hashable]] = field(default_factory=list)

    @property
    def gpu_time_meaning(self) -> str:
        return GPU_TIME_MEANING[self.kind]

    @property
    def origin(self) -> int:
        """Time zero for plots: the first range's start, or the first event of any kind."""
        if self.ranges:
            return min(r.start for r in self.ranges)
        starts = [e.start for e in (*self.launches, *self.work)]
        return min(starts) if starts else 0


@dataclass
class RangeStats:
    """Figures for one range name (summed over its ``count`` instances) or for a whole trace."""

    count: int = 0
    wall_ns: int = 0
    gpu_ns: int = 0
    kernels: int = 0
    launches: int = 0
    launch_gap_ns: int = 0
    idle_ns: int = 0

    def add(self, other: "RangeStats") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def to_json(self) -> dict:
        return {"count": self.count, "wall_ms": _ms(self.wall_ns), "gpu_time_ms": _ms(self.gpu_ns),
                "kernels": self.kernels, "launches": self.launches,
                "launch_gap_ms": _ms(self.launch_gap_ns), "idle_ms": _ms(self.idle_ns)}


def _ms(ns: int) -> float:
    return round(ns / NS_PER_MS, 6)


# ---------------------------------------------------------------- reading

def read_timeline(path: str | Path) -> Timeline:
    """Read an nsys ``.sqlite`` export or a torch.profiler Chrome trace (``.json``, ``.json.gz``).

    The format is recognised from the content, not the file name. Raises :class:`TraceReadError`
    naming the file and what was expected when it is neither.
    """
    path = Path(path)
    if not path.is_file():
        raise TraceReadError(f"{path}: file not found")
    try:
        with path.open("rb") as fh:
            head = fh.read(16)
    except OSError as exc:
        raise TraceReadError(f"{path}: cannot read: {exc.strerror}") from exc
    if head.startswith(SQLITE_MAGIC):
        return _read_nsys_sqlite(path)
    if head.startswith(GZIP_MAGIC) or head.lstrip()[:1] in (b"{", b"["):
        return _read_chrome_trace(path)
    hint = (" (an nsys report: export it first with `nsys export --type sqlite`)"
            if path.suffix in (".nsys-rep", ".qdrep") else "")
    raise TraceReadError(f"{path}: not a profile this tool reads{hint}; expected an nsys SQLite export "
                         "(nsys export --type sqlite) or a torch.profiler Chrome trace (JSON)")


def _columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in db.execute(f"PRAGMA table_info({table})")}


def _read_nsys_sqlite(path: Path) -> Timeline:
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError as exc:
        raise TraceReadError(f"{path}: unreadable SQLite file: {exc}") from exc
    try:
        profile_tables = {"NVTX_EVENTS", "CUPTI_ACTIVITY_KIND_KERNEL"} & tables
        if "StringIds" not in tables or not profile_tables:
            found = ", ".join(sorted(tables)) or "none"
            raise TraceReadError(
                f"{path}: an SQLite file but not an nsys export: expected tables StringIds and "
                f"NVTX_EVENTS and/or CUPTI_ACTIVITY_KIND_KERNEL (profile with "
                f"`nsys profile --trace=cuda,nvtx`), found: {found}")
        return Timeline(path, KIND_NSYS, *_nsys_events(db, tables))
    except sqlite3.DatabaseError as exc:
        raise TraceReadError(f"{path}: nsys export with an unexpected schema: {exc}") from exc
    finally:
        db.close()


def _nsys_events(db: sqlite3.Connection, tables: set[str]):
    ranges: list[RangeEvent] = []
    if "NVTX_EVENTS" in tables:
        text_id = "textId" in _columns(db, "NVTX_EVENTS")  # older exports carry text only
        name = "COALESCE(e.text, s.value)" if text_id else "e.text"
        join = "LEFT JOIN StringIds s ON s.id = e.textId" if text_id else ""
        rows = db.execute(
            f"SELECT e.start, e.end, {name}, e.globalTid FROM NVTX_EVENTS e {join} "
            f"WHERE e.eventType IN (?, ?) AND e.end IS NOT NULL AND e.end >= e.start",
            (NSYS_PUSH_POP_RANGE, NSYS_START_END_RANGE))
        ranges = [RangeEvent(str(n), int(s), int(e), int(t)) for s, e, n, t in rows if n is not None]

    kernel_rows: list[tuple[int, int, int, int | None]] = []
    if "CUPTI_ACTIVITY_KIND_KERNEL" in tables:
        pid = "globalPid >> 24" if "globalPid" in _columns(db, "CUPTI_ACTIVITY_KIND_KERNEL") else "NULL"
        kernel_rows = list(db.execute(
            f"SELECT start, end, correlationId, {pid} FROM CUPTI_ACTIVITY_KIND_KERNEL"))

    launched: set[tuple[int | None, int]] = {(p, c) for _, _, c, p in kernel_rows}
    launches: list[LaunchCall] = []
    by_correlation: dict[tuple[int | None, int], LaunchCall] = {}
    if "CUPTI_ACTIVITY_KIND_RUNTIME" in tables:
        rows = db.execute("SELECT r.start, r.end, r.globalTid, r.correlationId, s.value "
                          "FROM CUPTI_ACTIVITY_KIND_RUNTIME r LEFT JOIN StringIds s ON s.id = r.nameId")
        for start, end, tid, corr, api in rows:
            call = LaunchCall(int(start), int(end), int(tid))
            keys = [(int(tid) >> 24, corr), (None, corr)]
            if any(k in launched for k in keys) or "Launch" in (api or ""):
                launches.append(call)
                for k in keys:
                    by_correlation[k] = call

    work = []
    for start, end, corr, pid in kernel_rows:
        call = by_correlation.get((pid, corr))
        work.append(DeviceWork(int(start), int(end), call.thread if call else None,
                               call.start if call else int(start)))
    return ranges, launches, work


def _load_chrome_json(path: Path):
    try:
        raw = path.read_bytes()
        if raw.startswith(GZIP_MAGIC):
            raw = gzip.decompress(raw)
        return json.loads(raw)
    except (OSError, EOFError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TraceReadError(f"{path}: unreadable Chrome trace (expected torch.profiler JSON, "
                             f"optionally gzipped): {exc}") from exc


def _read_chrome_trace(path: Path) -> Timeline:
    data = _load_chrome_json(path)
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise TraceReadError(f"{path}: JSON but not a Chrome trace: expected an object with a "
                             "'traceEvents' list (torch.profiler export_chrome_trace) or a list of events")
    complete = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"
                and isinstance(e.get("ts"), (int, float)) and isinstance(e.get("dur"), (int, float))]
    if not complete:
        raise TraceReadError(f"{path}: Chrome trace without complete events (ph 'X' with ts and dur); "
                             "expected a torch.profiler trace")

    def span(e: dict) -> tuple[int, int]:
        start = round(e["ts"] * 1000)  # Chrome traces count microseconds
        return start, start + round(e["dur"] * 1000)

    def thread(e: dict) -> tuple:
        return (e.get("pid"), e.get("tid"))

    def correlation(e: dict):
        args = e.get("args")
        return args.get("correlation") if isinstance(args, dict) else None

    ranges = [RangeEvent(str(e.get("name")), *span(e), thread(e))
              for e in complete if e.get("cat") == "user_annotation"]
    kernels = [e for e in complete if e.get("cat") == "kernel"]
    if kernels:
        launched = {correlation(k) for k in kernels} - {None}
        launches, by_correlation = [], {}
        for e in complete:
            if e.get("cat") in ("cuda_runtime", "cuda_driver"):
                corr = correlation(e)
                if corr in launched or "Launch" in str(e.get("name")):
                    call = LaunchCall(*span(e), thread(e))
                    launches.append(call)
                    if corr is not None:
                        by_correlation[corr] = call
        work = []
        for k in kernels:
            start, end = span(k)
            call = by_correlation.get(correlation(k))
            work.append(DeviceWork(start, end, call.thread if call else None,
                                   call.start if call else start, str(k.get("name", ""))))
        return Timeline(path, KIND_CHROME_GPU, ranges, launches, work)

    all_ops = [(*span(e), thread(e)) for e in complete if e.get("cat") == "cpu_op"]
    ops = _top_level(all_ops)
    launches = [LaunchCall(s, e, t) for s, e, t in ops]
    work = [DeviceWork(s, e, t, s) for s, e, t in ops]
    return Timeline(path, KIND_CHROME_CPU, ranges, launches, work, cpu_ops=all_ops)


def _top_level(ops: list[tuple[int, int, Hashable]]) -> list[tuple[int, int, Hashable]]:
    """The operators not nested inside another operator on the same thread."""
    by_thread: dict[Hashable, list[tuple[int, int]]] = {}
    for start, end, t in ops:
        by_thread.setdefault(t, []).append((start, end))
    top = []
    for t, spans in by_thread.items():
        spans.sort(key=lambda s: (s[0], -s[1]))  # an enclosing op sorts before what it contains
        open_end = None
        for start, end in spans:
            if open_end is None or start >= open_end:
                top.append((start, end, t))
                open_end = end
            else:
                open_end = max(open_end, end)  # a partial overlap (clock jitter) extends the parent
    top.sort(key=lambda o: o[0])
    return top


# ---------------------------------------------------------------- figures

def union_ns(spans: Iterable[tuple[int, int]]) -> int:
    """Total length covered by the intervals (overlaps counted once)."""
    total, cur_start, cur_end = 0, None, None
    for start, end in sorted(spans):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def _gaps_ns(calls: list[LaunchCall]) -> int:
    """Sum of the CPU gaps between consecutive calls (sorted by start) on one thread."""
    gap, last_end = 0, None
    for call in sorted(calls, key=lambda c: c.start):
        if last_end is not None and call.start > last_end:
            gap += call.start - last_end
        last_end = call.end if last_end is None else max(last_end, call.end)
    return gap


def _work_stats(work: list[DeviceWork]) -> tuple[int, int]:
    """(busy, idle) of device work: busy = union; idle = its [first start, last end] window - busy."""
    if not work:
        return 0, 0
    busy = union_ns((w.start, w.end) for w in work)
    window = max(w.end for w in work) - min(w.start for w in work)
    return busy, window - busy


class _ThreadIndex:
    """Items of one kind per thread, sorted by a time key, for range queries by bisection."""

    def __init__(self, items, thread_of, time_of):
        self._items: dict[Hashable, list] = {}
        for item in items:
            self._items.setdefault(thread_of(item), []).append(item)
        self._keys = {}
        for t, lst in self._items.items():
            lst.sort(key=time_of)
            self._keys[t] = [time_of(i) for i in lst]

    def within(self, thread: Hashable, start: int, end: int) -> list:
        keys = self._keys.get(thread)
        if not keys:
            return []
        return self._items[thread][bisect.bisect_left(keys, start):bisect.bisect_right(keys, end)]


def range_stats(timeline: Timeline) -> dict[str, RangeStats]:
    """Figures per range name, summed over instances, in order of each name's first start."""
    launches = _ThreadIndex(timeline.launches, lambda c: c.thread, lambda c: c.start)
    work = _ThreadIndex([w for w in timeline.work if w.launch_thread is not None],
                        lambda w: w.launch_thread, lambda w: w.launch_time)
    stats: dict[str, RangeStats] = {}
    cpu_ops = _ThreadIndex(timeline.cpu_ops, lambda o: o[2], lambda o: o[0])
    for r in sorted(timeline.ranges, key=lambda r: (r.start, -r.end)):
        if timeline.kind == KIND_CHROME_CPU:
            # the operators that are outermost *within* this range (a range may sit inside an op)
            inside = _top_level(cpu_ops.within(r.thread, r.start, r.end))
            calls = [LaunchCall(s, e, t) for s, e, t in inside]
            issued = [DeviceWork(s, e, t, s) for s, e, t in inside]
        else:
            calls = launches.within(r.thread, r.start, r.end)
            issued = work.within(r.thread, r.start, r.end)
        busy, idle = _work_stats(issued)
        one = RangeStats(count=1, wall_ns=r.end - r.start, gpu_ns=busy, kernels=len(issued),
                         launches=len(calls), launch_gap_ns=_gaps_ns(calls), idle_ns=idle)
        stats.setdefault(r.name, RangeStats()).add(one)
    return stats


def total_stats(timeline: Timeline) -> RangeStats:
    """Figures for the whole trace: wall = first to last event; gaps summed per thread."""
    spans = [(e.start, e.end) for e in (*timeline.ranges, *timeline.launches, *timeline.work)]
    busy, idle = _work_stats(timeline.work)
    per_thread: dict[Hashable, list[LaunchCall]] = {}
    for call in timeline.launches:
        per_thread.setdefault(call.thread, []).append(call)
    return RangeStats(count=1,
                      wall_ns=(max(e for _, e in spans) - min(s for s, _ in spans)) if spans else 0,
                      gpu_ns=busy, kernels=len(timeline.work), launches=len(timeline.launches),
                      launch_gap_ns=sum(_gaps_ns(c) for c in per_thread.values()), idle_ns=idle)


# ---------------------------------------------------------------- comparison

@dataclass
class Comparison:
    """Two timelines side by side: per range name (A's order, then B-only names) and totals."""

    a: Timeline
    b: Timeline
    labels: tuple[str, str]
    ranges: list[tuple[str, RangeStats | None, RangeStats | None]] = field(default_factory=list)
    totals: tuple[RangeStats, RangeStats] = field(default_factory=lambda: (RangeStats(), RangeStats()))


def compare(a: Timeline, b: Timeline, labels: tuple[str, str] = ("A", "B")) -> Comparison:
    stats_a, stats_b = range_stats(a), range_stats(b)
    names = list(stats_a) + [n for n in stats_b if n not in stats_a]
    rows = [(n, stats_a.get(n), stats_b.get(n)) for n in names]
    return Comparison(a, b, labels, rows, (total_stats(a), total_stats(b)))


def _delta(a: RangeStats | None, b: RangeStats | None) -> dict | None:
    if a is None or b is None:
        return None
    ja, jb = a.to_json(), b.to_json()
    return {k: round(jb[k] - ja[k], 6) for k in ja}


def comparison_json(cmp: Comparison) -> dict:
    """``{"a": {...}, "b": {...}, "ranges": [{"name", "a", "b", "delta"}], "totals": {...}}``."""
    def side(t: Timeline, label: str) -> dict:
        return {"label": label, "path": str(t.path), "kind": t.kind, "gpu_time_means": t.gpu_time_meaning}

    return {
        "a": side(cmp.a, cmp.labels[0]),
        "b": side(cmp.b, cmp.labels[1]),
        "ranges": [{"name": n, "a": sa.to_json() if sa else None, "b": sb.to_json() if sb else None,
                    "delta": _delta(sa, sb)} for n, sa, sb in cmp.ranges],
        "totals": {"a": cmp.totals[0].to_json(), "b": cmp.totals[1].to_json(),
                   "delta": _delta(*cmp.totals)},
    }


_COLUMNS = (  # (header, RangeStats -> value, format, show delta)
    ("n", lambda s: s.count, "{:d}", False),
    ("gpu ms", lambda s: s.gpu_ns / NS_PER_MS, "{:.3f}", True),
    ("kernels", lambda s: s.kernels, "{:d}", True),
    ("launches", lambda s: s.launches, "{:d}", True),
    ("gap ms", lambda s: s.launch_gap_ns / NS_PER_MS, "{:.3f}", True),
    ("idle ms", lambda s: s.idle_ns / NS_PER_MS, "{:.3f}", True),
    ("wall ms", lambda s: s.wall_ns / NS_PER_MS, "{:.3f}", False),
)


def _cells(sa: RangeStats | None, sb: RangeStats | None) -> list[str]:
    cells = []
    for _, get, fmt, with_delta in _COLUMNS:
        va = get(sa) if sa else None
        vb = get(sb) if sb else None
        cells += [fmt.format(va) if va is not None else "-", fmt.format(vb) if vb is not None else "-"]
        if with_delta:
            cells.append(("+" + fmt.format(vb - va)).replace("+-", "-")
                         if va is not None and vb is not None else "-")
    return cells


def format_comparison(cmp: Comparison) -> str:
    """A plain-text table: per range name A, B and B - A for each figure, then the totals."""
    la, lb = cmp.labels
    lines = [f"A = {la}: {cmp.a.path} ({cmp.a.kind})", f"    {cmp.a.gpu_time_meaning}",
             f"B = {lb}: {cmp.b.path} ({cmp.b.kind})", f"    {cmp.b.gpu_time_meaning}",
             "Per range name, summed over its n instances; work counts toward a range when its "
             "thread launched it inside the range; gap = CPU time between launch calls; "
             "idle = device time between the range's first and last kernel not spent on its kernels.",
             ""]
    header = ["range"]
    for title, _, _, with_delta in _COLUMNS:
        header += [f"{title} A", f"{title} B"] + (["delta"] if with_delta else [])
    body = [[name] + _cells(sa, sb) for name, sa, sb in cmp.ranges]
    body.append(["TOTAL (whole trace)"] + _cells(*cmp.totals))
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    for i, row in enumerate([header, *body]):
        if i == len(body):  # a rule above the totals
            lines.append("-" * (sum(widths) + 2 * (len(widths) - 1)))
        lines.append("  ".join(c.ljust(w) if j == 0 else c.rjust(w)
                               for j, (c, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)
