"""Several ranks on gloo over 127.0.0.1: failure handling (parity across ranks is in test_parity.py)."""

import pytest

from infinity.testing.parity import engine_config, run_with_a_dying_rank


@pytest.mark.slow
def test_a_dead_rank_makes_the_other_fail_with_a_clear_error_in_bounded_time(tmp_path):
    cfg = engine_config("cpu", **{"infinity.comm_timeout_s": 30})
    record = run_with_a_dying_rank(cfg, str(tmp_path / "rank0.json"))
    assert not record["hung"], "rank 0 must not hang"
    assert record["error"] == "RankFailure", record
    assert "failed on rank 0 of 2" in record["message"] and "another rank probably died" in record["message"]
    assert record["seconds"] < 30, record


@pytest.mark.slow
def test_a_hung_rank_makes_the_other_fail_after_the_comm_timeout(tmp_path):
    cfg = engine_config("cpu", **{"infinity.comm_timeout_s": 4})
    record = run_with_a_dying_rank(cfg, str(tmp_path / "rank0.json"), how="hang")
    assert not record["hung"], "rank 0 must not hang"
    assert record["error"] == "RankFailure", record
    assert 3 <= record["seconds"] < 30, record


def _gloo_threads() -> list[str]:
    import os

    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass  # that thread ended while we looked
    return sorted(n for n in names if "gloo" in n)


def _threads_rank(rank, world, port, out_path):
    import gc
    import json

    import torch
    import torch.distributed as dist

    from infinity.testing.parity import MODEL, GPT, engine_config, gloo_rank, train_step
    from infinity.engine import initialize, zero_init

    record = {}
    with gloo_rank(rank, world, port):
        cfg = engine_config("cpu")
        torch.manual_seed(0)
        with zero_init(cfg):
            model = GPT(MODEL)
        import torch._dynamo  # noqa: F401 - a script that compiles something, after the group exists
        engine = initialize(model, cfg)
        try:
            train_step(engine, 0)
        finally:
            engine.close()
        record["running"] = _gloo_threads()
    gc.collect()
    record["initialized"] = dist.is_initialized()
    record["after"] = _gloo_threads()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(record, f)


@pytest.mark.slow
def test_destroy_process_group_ends_the_gloo_threads(tmp_path):
    # [Note: a process group that outlives destroy_process_group] in infinity/engine/comm.py: a group kept
    # alive by torch.distributed.nn's default arguments took its threads into interpreter shutdown.
    import json

    import torch.multiprocessing as mp

    from infinity.testing.parity import free_port

    out = tmp_path / "threads.json"
    mp.spawn(_threads_rank, args=(2, free_port(), str(out)), nprocs=2, join=True)
    record = json.loads(out.read_text())
    assert record["running"], "no gloo threads seen while the group was up: this check would prove nothing"
    assert not record["initialized"]
    assert record["after"] == [], f"gloo threads still running after destroy_process_group: {record['after']}"


@pytest.mark.slow
def test_a_group_never_destroyed_is_destroyed_at_exit(tmp_path):
    # DeepSpeed-style scripts never call destroy_process_group; a gloo group alive into interpreter shutdown
    # aborted a rank now and then ([Note: a process group that outlives destroy_process_group]).
    import subprocess
    import sys

    from infinity.testing.parity import free_port

    script = tmp_path / "script.py"
    script.write_text(
        "import atexit\n"
        "import torch, torch.distributed as dist\n"
        "atexit.register(lambda: print('at exit, group alive:', dist.is_initialized(), flush=True))\n"
        "import infinity.deepspeed  # registered after the line above, so its handler runs before it\n"
        f"dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{free_port()}', rank=0, world_size=1)\n"
        "t = torch.ones(2); dist.all_reduce(t)\n"
        "print('trained', flush=True)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == "trained at exit, group alive: False".split(), out.stdout


def _disk_room_rank(rank: int, world: int, port: int, swap: str, out: str):
    import json
    import shutil
    from collections import namedtuple

    import torch

    from infinity.config import ConfigError
    from infinity.engine import initialize
    from infinity.testing.parity import gloo_rank

    if rank == 1:  # only this rank's disk is full
        usage = namedtuple("usage", "total used free")
        shutil.disk_usage = lambda p: usage(10**9, 10**9 - 100, 100)
    nvme = {"device": "nvme", "nvme_path": f"{swap}/rank{rank}"}
    cfg = {"train_micro_batch_size_per_gpu": 2, "infinity": {"comm_timeout_s": 60},
           "zero_optimization": {"stage": 3, "offload_param": nvme, "offload_optimizer": nvme}}
    record = {}
    with gloo_rank(rank, world, port):
        try:
            initialize(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)), cfg)
        except ConfigError as exc:
            record = {"error": type(exc).__name__, "message": str(exc)}
        else:
            record = {"error": None}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(record, f)


@pytest.mark.slow
def test_a_full_disk_on_one_rank_stops_every_rank_with_a_config_error(tmp_path):
    """The disk-room check runs on every rank before anything is written; one rank's failure reaches the
    others as a ConfigError that sends them to its message, not as a checkpoint or rank failure."""
    import json

    import torch.multiprocessing as mp

    from infinity.testing.parity import free_port

    swap = tmp_path / "swap"
    mp.spawn(_disk_room_rank, args=(2, free_port(), str(swap), str(tmp_path)), nprocs=2, join=True)
    mine, theirs = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (1, 0))
    assert mine["error"] == "ConfigError" and "has 100 bytes free, but the swap files of this host's ranks need" \
        in mine["message"], mine
    assert theirs == {"error": "ConfigError",
                      "message": "the disk-room check failed on another rank (its own error says why)"}, theirs
    assert not [f for f in swap.rglob("*") if f.is_file()], "nothing was written on either rank"



def _failed_backward_rank(rank: int, world: int, port: int, out: str, bucket: int, fail: bool):
    import json

    import torch

    from infinity.engine import initialize
    from infinity.testing.parity import gloo_rank

    class Tripwire(torch.nn.Module):
        """Passes its input through; armed, the gradient reaching it raises, as an OOM in backward would."""

        armed = False

        def forward(self, x):
            if Tripwire.armed and x.requires_grad:
                def trip(grad):
                    Tripwire.armed = False
                    raise RuntimeError("tripwire")

                x = x.view_as(x)
                x.register_hook(trip)
            return x

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), Tripwire(), torch.nn.Linear(32, 32),
                                torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "infinity": {"comm_timeout_s": 60},
           "zero_optimization": {"stage": 3, "reduce_bucket_size": bucket,
                                 "stage3_param_persistence_threshold": 0}}
    gen = torch.Generator().manual_seed(100 + rank)
    xs = [torch.randn(4, 16, generator=gen) for _ in range(3)]
    with gloo_rank(rank, world, port):
        e = initialize(model, cfg)
        for k, x in enumerate(xs):
            if k == 1:  # the batch whose backward fails (or, in the reference run, is never seen)
                if not fail:
                    continue
                Tripwire.armed = True
                loss = e(x).pow(2).mean()
                try:
                    e.backward(loss)
                except RuntimeError as exc:
                    assert "tripwire" in str(exc), exc
                else:
                    raise AssertionError("the tripwire did not fire")
                e.zero_grad()
                continue
            loss = e(x).pow(2).mean()
            e.backward(loss)
            e.step()
        import infinity

        with infinity.gathered_parameters(e.module):
            weights = {k: v.tolist() for k, v in e.module.state_dict().items()}
        e.close()
    with open(f"{out}/rank{rank}-{fail}.json", "w") as f:
        json.dump(weights, f)


@pytest.mark.slow
@pytest.mark.parametrize("bucket", [5000, 1200], ids=["stale-open-bucket", "stale-reduce-scatter-in-flight"])
def test_a_backward_that_fails_part_way_sends_nothing_with_the_next_one(tmp_path, bucket):
    """A backward raises after its last layers' gradients were bucketed (bucket 5000: still in the open bucket;
    1200: sent, the reduce-scatter in flight); the user zeroes the gradients and goes on, as with torch. The
    next step must be the one a run without that batch takes, bit for bit, on both ranks: before the fix the
    failed backward's gradients went out with the next backward's."""
    import json

    import torch.multiprocessing as mp

    from infinity.testing.parity import free_port

    for fail in (True, False):
        mp.spawn(_failed_backward_rank, args=(2, free_port(), str(tmp_path), bucket, fail), nprocs=2, join=True)
    runs = {(r, f): json.loads((tmp_path / f"rank{r}-{f}.json").read_text()) for r in (0, 1) for f in (True, False)}
    assert runs[(0, True)] == runs[(1, True)], "the ranks agree"
    assert runs[(0, True)] == runs[(0, False)], "the failed backward left nothing in the next step"


def test_a_backward_failed_by_a_dead_rank_does_not_wait_for_its_reduce_scatter_again():
    """After a RankFailure the reduce-scatter in flight would only time out once more (another comm timeout
    before the error reaches the user): it is dropped unwaited. Any other failure waits for it (every rank
    started it)."""
    from types import SimpleNamespace

    from infinity.engine.buckets import GradientBuckets
    from infinity.engine.optimizer import ShardedAdam
    from infinity.errors import RankFailure

    for error, waits in ((RankFailure("rank 1 died"), 0), (RuntimeError("out of memory"), 1)):
        waited = []
        buckets = GradientBuckets(SimpleNamespace(world=2), sink=None, reduce_bucket=10)
        buckets._bucket, buckets._elements = [("mp", None)], 5
        buckets._in_flight = (SimpleNamespace(wait=lambda: waited.append(1)), [])
        ShardedAdam.backward_failed(SimpleNamespace(buckets=buckets), error)
        assert len(waited) == waits and buckets._in_flight is None and not buckets._bucket, error
