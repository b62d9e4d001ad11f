"""What a person watching `infinity train` sees: a progress bar in a terminal, plain lines in a log file, and a
summary at the end.

In a terminal the bar is tqdm's (elapsed, ETA, rate), with the loss, smoothed
tokens/s, I/O GB/s and peak RSS as its postfix; tqdm redraws the whole line, so
nothing of a longer earlier line is left behind. Other messages go through
`say`, which prints above the bar. Without a terminal (a log file, CI) it
writes one plain line every `every` steps and at the last step.
"""

from __future__ import annotations

import sys
import time


class Progress:
    """Rank 0's view of the run; every method is a no-op on other ranks (enabled=False)."""

    def __init__(self, *, total: int, start: int, enabled: bool, every: int | None = None, stream=None):
        self.total, self.start, self.enabled = total, start, enabled
        self.stream = stream or sys.stdout
        self.t0 = time.perf_counter()
        self.tokens = 0
        self.rate = None  # tokens/s, exponentially smoothed over steps
        self.bar = None
        if self.enabled and self.stream.isatty():
            try:
                from tqdm import tqdm
            except ImportError:  # plain lines, as in a log file
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, file=self.stream,
                                smoothing=0.1)
        self.every = every or max(1, (total - start) // 20)

    def say(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def update(self, row: dict) -> None:
        if not self.enabled:
            return
        self.tokens += row["tokens"]
        rate = row["tokens"] / row["step_s"]
        self.rate = rate if self.rate is None else 0.8 * self.rate + 0.2 * rate
        io = (row["io_read_bytes"] + row["io_write_bytes"]) / row["step_s"] / 1e9
        fields = {"loss": f"{row['loss']:.4f}", "tok/s": f"{self.rate:,.0f}", "I/O": f"{io:.2f} GB/s",
                  "RSS": f"{row['peak_rss_bytes'] / 2**20:,.0f} MiB"}
        if row.get("eval_loss") is not None:
            fields["eval"] = f"{row['eval_loss']:.4f}"
        if self.bar is not None:
            self.bar.set_postfix(fields, refresh=False)
            self.bar.update(1)
            return
        step = row["step"]
        if step % self.every and step != self.total:
            return
        elapsed = time.perf_counter() - self.t0
        done = step - self.start
        eta = elapsed / done * (self.total - step) if done else 0.0
        print(f"step {step}/{self.total}  " + "  ".join(f"{k} {v}" for k, v in fields.items()) +
              f"  elapsed {_hms(elapsed)}  eta {_hms(eta)}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def summary(self, *, rows: list, out_dir, model_dir, peak_rss: int) -> None:
        if not self.enabled or not rows:
            return
        elapsed = time.perf_counter() - self.t0
        moved = sum(r["io_read_bytes"] + r["io_write_bytes"] for r in rows)
        first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / len(rows[-5:])
        lines = [f"done: {len(rows)} steps in {_hms(elapsed)}, {self.tokens:,} tokens, "
                 f"{self.tokens / elapsed:,.0f} tokens/s mean, peak RSS {peak_rss / 2**20:,.0f} MiB, "
                 f"{moved / 1e9:.2f} GB moved to and from swap",
                 f"loss {first:.3f} -> {last:.3f} (mean of the last {min(5, len(rows))} steps); metrics in "
                 f"{out_dir}/metrics.jsonl"]
        bets = [r.get("speculation") for r in rows if r.get("speculation")]
        if bets:  # [Note: the speculative step] in engine/optimizer.py
            lost = bets.count("redone")
            lines.append(f"steps taken during backward as a bet on no clipping: {len(bets) - lost} committed, "
                         f"{lost} rolled back and taken after backward")
        if model_dir is not None:
            lines.append(f"model written to {model_dir}")
        for line in lines:
            self.say(line)


def _hms(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
