"""StepReport: what one optimizer step did (engine.last_report; a line of `infinity train`'s metrics.jsonl)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class StepReport:
    """What one optimizer step did (engine.last_report; one line of `infinity train`'s metrics.jsonl)."""

    step: int
    skipped: bool
    loss_scale: float
    grad_norm: float
    step_s: float
    """From the end of the previous step to the end of this one (forward, backward and optimizer)."""
    optimizer_s: float
    param_fetches: int
    prefetch_hits: int
    param_lent: int
    """Fetches served from the optimizer's master weights instead of a read (see [Note: backward reads from
    the state] in optimizer.py)."""
    param_staged: int
    """Fetches served from a copy the step finished in forward staged (see [Note: stepped shards are staged] in
    deferred.py)."""
    param_critical_reads: int
    """Fetches that read their shard from disk on the critical path: the misses not served from memory."""
    param_stall_s: float
    """Exposed parameter I/O: time forward/backward waited on shard reads."""
    optimizer_io_wait_s: float
    """Exposed optimizer I/O."""
    param_read_bytes: int
    optimizer_read_bytes: int
    optimizer_write_bytes: int
    param_write_bytes: int
    peak_live_elements: int
    comm_s: float = 0.0
    """Time in blocking collectives (gathers, gradient reduce-scatters, norms) since the previous step."""
    gathered_bytes: int = 0
    """Full parameters materialised (forward and backward), from any tier: the CPU/device tier's traffic."""
    speculation: str | None = None
    """The step taken during backward as a bet ([Note: the speculative step] in optimizer.py): "committed", or
    "redone" (rolled back and taken after backward; the bet's I/O is in the byte counts); None: no bet."""

    @property
    def prefetch_hit_rate(self) -> float:
        return self.prefetch_hits / self.param_fetches if self.param_fetches else 1.0

    @property
    def exposed_io_s(self) -> float:
        return self.param_stall_s + self.optimizer_io_wait_s

    @property
    def io_read_bytes(self) -> int:
        return self.param_read_bytes + self.optimizer_read_bytes

    @property
    def io_write_bytes(self) -> int:
        return self.optimizer_write_bytes + self.param_write_bytes
