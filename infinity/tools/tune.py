"""`infinity tune`: find the fastest `aio` settings for one disk, within a time budget.

The job of DeepSpeed's `ds_nvme_tune`, bounded in time. One file of --size
bytes is laid out on --nvme-path, then each candidate setting times a full
O_DIRECT write and a full read of it. The search runs in stages, so that a
short budget still covers what matters most:

  1. coarse: every backend x block size x queue depth (1 worker, batched, overlapped);
  2. knobs: workers, single_submit and overlap_events around the two best;
  3. refine: the best one's neighbouring block sizes and queue depths;
  4. confirm: the three best are measured again, round after round while the
     budget lasts (at most 8 rounds); the best median among them wins.

Stages 1-3 stop taking new candidates at 75 % of the budget; stage 4 fits in
the rest. A setting is scored by the time to read and write the same number
of bytes (the harmonic mean of the two GB/s), since a swap step moves about
as much each way. The last line printed is the winning `aio` section as JSON,
with DeepSpeed's key names and real booleans: it loads unchanged into our
config and into DeepSpeed's (which ignores our `backend` key).
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field

from infinity.io import AsyncIO, aligned_empty, available_backends
from infinity.units import format_size, parse_size

BLOCK_SIZES = (256 << 10, 1 << 20, 4 << 20)
QUEUE_DEPTHS = (8, 32, 128)
WORKERS = (1, 2)
THREADS_BACKEND_WORKERS = (1, 2, 4)  # the threads backend's concurrency is its worker count
SEARCH_SHARE = 0.75


@dataclass(frozen=True, slots=True)
class Setting:
    backend: str
    block_size: int
    queue_depth: int
    threads: int = 1
    single_submit: bool = False
    overlap_events: bool = True

    def aio_section(self) -> dict:
        """The `aio` section, with DeepSpeed's key names and JSON booleans."""
        return {"block_size": self.block_size, "queue_depth": self.queue_depth,
                "intra_op_parallelism": self.threads, "single_submit": self.single_submit,
                "overlap_events": self.overlap_events, "backend": self.backend}


@dataclass(slots=True)
class Measured:
    setting: Setting
    read: list = field(default_factory=list)   # GB/s (1e9 B/s) per pass
    write: list = field(default_factory=list)

    @property
    def read_gbps(self) -> float:
        return statistics.median(self.read)

    @property
    def write_gbps(self) -> float:
        return statistics.median(self.write)

    @property
    def score(self) -> float:
        """GB/s when moving equal bytes each way: the harmonic mean of read and write."""
        return 2.0 / (1.0 / self.read_gbps + 1.0 / self.write_gbps)


def parse_duration(text: str, *, name: str = "duration") -> float:
    """'60s', '2m', '90' (seconds) -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min)?\s*", str(text))
    if not m:
        raise ValueError(f"{name}: cannot read {text!r} as a duration; write e.g. 60s, 90 or 2m")
    value = float(m.group(1)) * (60.0 if (m.group(2) or "s").startswith("m") else 1.0)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {text!r}")
    return value


class Tuner:
    """Measures settings on one file until the budget is spent."""

    def __init__(self, directory: str, size: int, budget_s: float, backends: list[str], log=print):
        self.path = os.path.join(directory, f"infinity-tune-{os.getpid()}.dat")
        self.size = size
        self.budget_s = budget_s
        self.backends = backends
        self.log = log
        self.results: dict[Setting, Measured] = {}
        self.t0 = time.perf_counter()
        self.case_s = 0.0  # the slowest case so far: a candidate starts only if one more fits
        self.buf = aligned_empty(size, pin=False)
        self.buf.copy_(_pattern(size))

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def fits(self, share: float) -> bool:
        return self.elapsed() + self.case_s <= self.budget_s * share

    def lay_out(self) -> None:
        with AsyncIO(backend=self.backends[0]) as h:
            h.write(self.buf, self.path)

    def measure(self, s: Setting) -> Measured:
        t = time.perf_counter()
        m = self.results.setdefault(s, Measured(s))
        with AsyncIO(backend=s.backend, block_size=s.block_size, queue_depth=s.queue_depth, threads=s.threads,
                     single_submit=s.single_submit, overlap_events=s.overlap_events) as h:
            for op in ("write", "read"):
                start = time.perf_counter()
                (h.write if op == "write" else h.read)(self.buf, self.path)
                (m.write if op == "write" else m.read).append(self.size / (time.perf_counter() - start) / 1e9)
        self.case_s = max(self.case_s, time.perf_counter() - t)
        return m

    def _try(self, settings, share: float) -> None:
        for s in settings:
            if s in self.results:
                continue
            if not self.fits(share):
                return
            m = self.measure(s)
            self.log(_row(m, "search"))

    def _best(self, n: int) -> list[Measured]:
        return sorted(self.results.values(), key=lambda m: -m.score)[:n]

    def run(self) -> Measured:
        self.lay_out()
        self.t0 = time.perf_counter()  # the layout is not part of the budget: it is the same for every setting
        coarse = []
        for b in self.backends:
            if b == "threads":
                # Queue depth does not apply to threads (a blocking call per piece); 32 is recorded so that the
                # section stays sensible for an engine that reads it, e.g. DeepSpeed's libaio.
                coarse += [Setting(b, bs, 32, t) for bs in BLOCK_SIZES for t in THREADS_BACKEND_WORKERS]
            else:
                coarse += [Setting(b, bs, qd) for bs in BLOCK_SIZES for qd in QUEUE_DEPTHS]
        # Interleave the backends, so that a short budget samples each of them.
        per = [[s for s in coarse if s.backend == b] for b in self.backends]
        coarse = [s for group in zip(*_pad(per)) for s in group if s is not None]
        self._try(coarse, SEARCH_SHARE)
        knobs = []
        for m in self._best(2):
            s = m.setting
            if s.backend == "threads":
                continue
            for t in WORKERS:
                for ss in (False, True):
                    for oe in (True, False):
                        knobs.append(Setting(s.backend, s.block_size, s.queue_depth, t, ss, oe))
        self._try(knobs, SEARCH_SHARE)
        if self._best(1):
            s = self._best(1)[0].setting
            near = [Setting(s.backend, bs, s.queue_depth, s.threads, s.single_submit, s.overlap_events)
                    for bs in (s.block_size // 2, s.block_size * 2) if (128 << 10) <= bs <= (16 << 20)]
            if s.backend != "threads":
                near += [Setting(s.backend, s.block_size, qd, s.threads, s.single_submit, s.overlap_events)
                         for qd in (s.queue_depth // 2, s.queue_depth * 2) if 2 <= qd <= 512]
            self._try(near, SEARCH_SHARE)
        if not self.results:  # a budget too short for even one case still measures one
            self.log(_row(self.measure(coarse[0]), "search"))
        # One pass flatters whichever setting caught the disk at a good moment, so the finalists are measured
        # again, round after round, while the budget lasts; the winner is the best median among them.
        finalists = self._best(3)
        for _ in range(8):
            if self.elapsed() + len(finalists) * self.case_s > self.budget_s:
                break
            for m in finalists:
                self.measure(m.setting)
        finalists.sort(key=lambda m: -m.score)
        for m in finalists:
            self.log(_row(m, "confirm"))
        return finalists[0]

    def close(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)


def _pad(groups: list[list]) -> list[list]:
    n = max(len(g) for g in groups)
    return [g + [None] * (n - len(g)) for g in groups]


def _pattern(n: int):
    """n bytes of a 251-periodic pattern, built without an n-element wider temporary."""
    import torch

    period = torch.arange(251, dtype=torch.uint8)
    return period.repeat(-(-n // 251))[:n]


def _header() -> str:
    return (f"{'stage':8} {'backend':8} {'block':>6} {'qd':>4} {'thr':>3} {'single':>6} {'overlap':>7} "
            f"{'read GB/s':>9} {'write GB/s':>10} {'score':>6} {'passes':>6}")


def _row(m: Measured, stage: str) -> str:
    s = m.setting
    return (f"{stage:8} {s.backend:8} {format_size(s.block_size):>6} {s.queue_depth:>4} {s.threads:>3} "
            f"{str(s.single_submit).lower():>6} {str(s.overlap_events).lower():>7} {m.read_gbps:9.3f} "
            f"{m.write_gbps:10.3f} {m.score:6.3f} {len(m.read):>6}")


def add_arguments(p) -> None:
    p.add_argument("--nvme-path", required=True, help="directory on the disk to tune (a file is created and removed)")
    p.add_argument("--budget", default="60s", help="time for the sweep, e.g. 60s or 2m (default 60s)")
    p.add_argument("--size", default="512MiB", help="bytes per timed pass (default 512MiB)")
    p.add_argument("--backend", action="append", default=None,
                   help="a backend to try (repeatable; default: every native backend that works here)")
    p.add_argument("--write", default=None, metavar="CONFIG",
                   help="put the best aio section into this JSON config (other keys are kept)")
    p.add_argument("--plot", default=None, metavar="PNG", help="write a heatmap of the coarse stage")


def run(args) -> int:
    from infinity._native_loader import native

    budget = parse_duration(args.budget, name="--budget")
    size = parse_size(args.size, name="--size")
    if size < (16 << 20) or size % 4096:
        raise ValueError(f"--size must be a multiple of 4096 and at least 16MiB, got {args.size}")
    if not os.path.isdir(args.nvme_path):
        raise ValueError(f"--nvme-path {args.nvme_path}: not a directory")
    if not os.access(args.nvme_path, os.W_OK):
        raise ValueError(f"--nvme-path {args.nvme_path}: not writable")
    if native is None or native.direct_alignment(args.nvme_path) == 0:
        raise ValueError(f"--nvme-path {args.nvme_path}: O_DIRECT is not supported here (tmpfs?); tune on the "
                         f"disk that will hold the swap files, or set aio.backend = \"threads\" with "
                         f"infinity.direct_io = false and skip tuning")
    usable = [b for b in available_backends() if b != "python"]
    backends = args.backend or usable
    for b in backends:
        if b not in usable:
            raise ValueError(f"--backend {b}: not usable here; available: {', '.join(usable)}")
    free = os.statvfs(args.nvme_path)
    if free.f_bavail * free.f_frsize < size + (64 << 20):
        raise ValueError(f"--nvme-path {args.nvme_path}: {format_size(size)} free is needed for the test file; "
                         f"lower --size")
    if args.write:
        _check_writable_config(args.write)
    print(f"# infinity tune: {args.nvme_path}, {format_size(size)} per pass, budget {budget:.0f} s, "
          f"backends {', '.join(backends)}", flush=True)
    print(_header(), flush=True)
    tuner = Tuner(args.nvme_path, size, budget, backends, log=lambda line: print(line, flush=True))
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so that `finally` removes the test file
    try:
        best = tuner.run()
    finally:
        tuner.close()
        signal.signal(signal.SIGTERM, previous)
    ranked = sorted(tuner.results.values(), key=lambda m: -m.score)
    best_read = max(ranked, key=lambda m: m.read_gbps)
    best_write = max(ranked, key=lambda m: m.write_gbps)
    print(f"# {len(ranked)} settings in {tuner.elapsed():.0f} s; best for reads: {_short(best_read.setting)} "
          f"({best_read.read_gbps:.3f} GB/s); best for writes: {_short(best_write.setting)} "
          f"({best_write.write_gbps:.3f} GB/s); best for both: {_short(best.setting)} "
          f"(read {best.read_gbps:.3f}, write {best.write_gbps:.3f} GB/s)", flush=True)
    if args.plot:
        _plot(list(tuner.results.values()), args.plot)
    section = best.setting.aio_section()
    if args.write:
        write_aio_section(args.write, section)
        print(f"# aio section written to {args.write}", flush=True)
    print(json.dumps(section), flush=True)
    return 0


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def _short(s: Setting) -> str:
    return (f"{s.backend} {format_size(s.block_size)} qd{s.queue_depth} x{s.threads}"
            + (" single" if s.single_submit else "") + ("" if s.overlap_events else " no-overlap"))


def _check_writable_config(path: str) -> None:
    """Fail before the sweep, not after it, if --write cannot succeed."""
    if os.path.exists(path):
        _read_json_object(path)
        if not os.access(path, os.W_OK):
            raise ValueError(f"--write {path}: not writable")
    elif not os.access(os.path.dirname(os.path.abspath(path)) or ".", os.W_OK):
        raise ValueError(f"--write {path}: its directory is not writable")


def _read_json_object(path: str) -> dict:
    with open(path) as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--write {path}: not valid JSON (line {exc.lineno}, column {exc.colno}: "
                             f"{exc.msg}); fix it or name a new file") from None
    if not isinstance(doc, dict):
        raise ValueError(f"--write {path}: the top level must be a JSON object")
    return doc


def write_aio_section(path: str, section: dict) -> None:
    """Replace (or add) the `aio` section of a JSON config, atomically; every other key is kept."""
    from infinity.config import load_config

    load_config({"aio": section})  # the section itself must be valid in our schema
    doc = _read_json_object(path) if os.path.exists(path) else {}
    doc["aio"] = section
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _plot(results: list[Measured], out: str) -> None:
    """Block size x queue depth per backend and op, for the coarse stage's settings."""
    from infinity.bench.io import IoResult, plot_heatmap

    rows = []
    for m in results:
        s = m.setting
        if s.threads != 1 and s.backend != "threads" or s.single_submit or not s.overlap_events:
            continue
        for op, gbps in (("read", m.read_gbps), ("write", m.write_gbps)):
            label = s.backend if s.backend != "threads" else "threads (x axis: workers)"
            rows.append(IoResult(op=op, backend=label, block_size=s.block_size,
                                 queue_depth=s.queue_depth if s.backend != "threads" else s.threads,
                                 threads=1, gbps=gbps, gbps_stdev=0.0, size=0, repeats=len(m.read), direct=True))
    if not rows:
        print("# --plot: no coarse-stage results to plot", file=sys.stderr)
        return
    plot_heatmap(rows, out)
