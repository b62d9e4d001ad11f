"""Several NVMe paths beside one: the bytes per second of a training step striped over two throttled disks.

This box has one disk, so two are made: two loop devices (files under --work, direct I/O on, ext4), each
throttled to --bps bytes/s of reads and of writes for the processes of a blkio cgroup (cgroup v1
blkio.throttle.*_bps_device, or v2 io.max). `infinity train --model M` then runs in that cgroup, alternately
with `--nvme-path A` and with `--nvme-path A --nvme-path B`, --pairs times; each run's median step after the
first gives bytes moved (the engine's counters) / step time. Needs root; everything made is removed at the end.

    sudo python bench/several_disks.py --model gpt-25m --bps 50M --pairs 2

Target (issue "Half the bytes", item 3): two disks move >= 1.8x the bytes per second of one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from infinity.units import parse_size


def sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


class ThrottledDisks:
    """Two loop devices with an ext4 each, mounted under `root`, throttled for the processes of one cgroup."""

    def __init__(self, root: Path, size: str, bps: int):
        self.root, self.size, self.bps = root, size, bps
        self.devices: list[str] = []
        self.mounts: list[Path] = []
        self.cgroup: Path | None = None

    def __enter__(self):
        try:
            for name in ("a", "b"):
                image = self.root / f"disk-{name}.img"
                sh("truncate", "-s", self.size, str(image))
                dev = sh("losetup", "-f", "--show", "--direct-io=on", str(image))
                self.devices.append(dev)
                sh("mkfs.ext4", "-q", "-F", dev)
                mount = self.root / name
                mount.mkdir()
                sh("mount", dev, str(mount))
                self.mounts.append(mount)
            self._throttle()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _throttle(self) -> None:
        numbers = []
        for dev in self.devices:
            st = os.stat(dev)
            numbers.append(f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}")
        v1 = Path("/sys/fs/cgroup/blkio")
        if v1.is_dir():
            self.cgroup = v1 / f"infinity-bench-{os.getpid()}"
            self.cgroup.mkdir()
            for kind in ("read", "write"):
                for n in numbers:
                    (self.cgroup / f"blkio.throttle.{kind}_bps_device").write_text(f"{n} {self.bps}")
            return
        v2 = Path("/sys/fs/cgroup")
        if (v2 / "cgroup.controllers").exists() and "io" in (v2 / "cgroup.controllers").read_text().split():
            self.cgroup = v2 / f"infinity-bench-{os.getpid()}"
            self.cgroup.mkdir()
            for n in numbers:
                (self.cgroup / "io.max").write_text(f"{n} rbps={self.bps} wbps={self.bps}")
            return
        raise SystemExit("bench several_disks: no blkio (cgroup v1) or io (cgroup v2) controller to throttle with")

    def run(self, cmd: list[str]) -> subprocess.CompletedProcess:
        """cmd in the throttled cgroup."""
        procs = self.cgroup / "cgroup.procs"
        return subprocess.run(["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *cmd], capture_output=True,
                              text=True)

    def __exit__(self, *exc) -> None:
        for mount in self.mounts:
            subprocess.run(["umount", str(mount)], capture_output=True)
        for dev in self.devices:
            subprocess.run(["losetup", "-d", dev], capture_output=True)
        if self.cgroup is not None:
            try:
                self.cgroup.rmdir()
            except OSError:
                pass


def one_run(disks: ThrottledDisks, model: str, steps: int, paths: list[Path], out: Path) -> dict:
    cmd = [sys.executable, "-m", "infinity", "train", "--model", model, "--steps", str(steps), "--out", str(out)]
    for p in paths:
        cmd += ["--nvme-path", str(p)]
    done = disks.run(cmd)
    if done.returncode != 0:
        raise SystemExit(f"bench several_disks: {' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    step = statistics.median(r["step_s"] for r in rows)
    moved = statistics.median(r["io_read_bytes"] + r["io_write_bytes"] for r in rows)
    return {"disks": len(paths), "step_s": step, "bytes": moved, "gb_per_s": moved / step / 1e9}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-25m")
    p.add_argument("--bps", default="50M", help="each disk's read and write limit, bytes/s (K/M/G = 2^10..)")
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--size", default="6G", help="each loop device's size")
    p.add_argument("--work", default="/var/tmp", help="where the loop devices' image files go")
    args = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench several_disks: needs root (loop devices, mounts and a cgroup)")
    bps = parse_size(args.bps, name="--bps")
    rows = []
    with tempfile.TemporaryDirectory(dir=args.work, prefix="infinity-disks.") as tmp:
        root = Path(tmp)
        with ThrottledDisks(root, args.size, bps) as disks:
            a, b = disks.mounts
            for k in range(args.pairs):
                for paths in ([a], [a, b]):
                    row = one_run(disks, args.model, args.steps, paths, root / f"run{k}-{len(paths)}")
                    rows.append(row)
                    print(f"{len(paths)} disk(s): step {row['step_s']:.2f} s, {row['bytes'] / 1e9:.3f} GB, "
                          f"{row['gb_per_s']:.3f} GB/s", flush=True)
    one = statistics.median(r["gb_per_s"] for r in rows if r["disks"] == 1)
    two = statistics.median(r["gb_per_s"] for r in rows if r["disks"] == 2)
    print(f"{args.model}, each disk {bps / 2**20:.0f} MiB/s: two disks move {two / one:.2f}x the bytes per second "
          f"of one (target >= 1.8)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
