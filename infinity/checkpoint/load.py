"""engine.load_checkpoint: verify everything this rank will read, then stream it into the engine's layout.

The checkpoint's world size and offload config do not need to match the
engine's: each rank reads its own range [r x part, (r+1) x part) of every
parameter's arrays, whatever chunks (the saving ranks' shards) it spans,
straight into its optimizer groups (pool buffers on NVMe, RAM tensors
otherwise). See [Note: checkpoint layout].

[Note: verify before load]
Nothing in the engine changes until every chunk this rank will read has
been read once and matched its CRC-32C, every rank has agreed, and the
model's names and shapes have been checked against the manifest. So a
missing, partial, corrupted or mismatched checkpoint raises with the engine
exactly as it was. The price is reading the checkpoint twice: the second
pass reads only the bytes needed, straight into place.
"""

from __future__ import annotations

import base64
import glob
import os
import pickle
import random
import warnings

import numpy as np
import torch

from infinity.checkpoint.layout import (FORMAT, LATEST, STATES, VERSION, CheckpointError, Manifest, check_tag,
                                        chunk_path, crc_of, partial_dir, read_json, read_latest)
from infinity.checkpoint.save import extra_tensors, rng_state, together
from infinity.checkpoint.stream import ChunkReader, Window, open_io
from infinity.dtypes import BY_NAME
from infinity.swap.state import moments_name
from infinity.errors import NoLatest  # noqa: F401 - raised here, defined there


def resolve(directory, tag: str | None = None) -> tuple[str, Manifest]:
    """(checkpoint root, manifest) of `tag` (default: the one DIR/latest names), or a CheckpointError saying why not."""
    directory = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(directory):
        raise (NoLatest if tag is None and not os.path.exists(directory) else CheckpointError)(
            f"no checkpoint at {directory}: " + ("it is not a directory" if os.path.exists(directory)
                                                 else "no such directory"))
    if tag is None:
        latest = os.path.join(directory, LATEST)
        tag = read_latest(directory)
        if tag is None:
            partials = sorted(os.path.basename(p) for p in glob.glob(os.path.join(directory, ".*.partial")))
            raise NoLatest(f"no checkpoint in {directory}: it has no '{LATEST}' file" + (
                f" (only the interrupted save(s) {partials})" if partials else "") + "; pass tag= to load a "
                "specific one")
        try:
            check_tag(tag)
        except ValueError:
            raise CheckpointError(f"{latest} is corrupted: it holds {tag[:80]!r}, not a checkpoint tag") from None
    check_tag(tag)
    root = os.path.join(directory, tag)
    if not os.path.isdir(root):
        if os.path.exists(partial_dir(directory, tag)):
            raise CheckpointError(f"checkpoint {tag!r} in {directory} is partial: its save was interrupted "
                                  f"({partial_dir(directory, tag)} was never completed); load another tag")
        tags = sorted(d for d in os.listdir(directory) if os.path.exists(os.path.join(directory, d, "zarr.json")))
        raise CheckpointError(f"checkpoint {tag!r} not found in {directory}; complete checkpoints there: {tags}")
    meta_path = os.path.join(root, "zarr.json")
    if not os.path.exists(meta_path):
        raise CheckpointError(f"checkpoint {root} is partial: it has no zarr.json (written last by a save)")
    try:
        meta = read_json(meta_path)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint {root} is corrupted: {meta_path} is not valid JSON ({exc})") from None
    m = meta.get("attributes", {}).get("infinity_checkpoint") if isinstance(meta, dict) else None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"{root} is not an infinity checkpoint (its zarr.json has no infinity_checkpoint "
                              "attribute)")
    if m.get("version", 0) > VERSION:
        raise CheckpointError(f"checkpoint {root} has format version {m.get('version')}; this infinity reads up to "
                              f"{VERSION}: upgrade infinity")
    if not m.get("complete"):
        raise CheckpointError(f"checkpoint {root} is partial: its manifest is not marked complete")
    stored = meta["attributes"].get("infinity_checkpoint_crc32c")
    try:
        actual = crc_of(m)
    except ValueError:
        actual = None
    if stored != actual:
        raise CheckpointError(f"checkpoint {root} is corrupted: its manifest ({meta_path}) does not match the "
                              f"CRC-32C stored with it")
    return root, Manifest.parse(m, root)


def check_compatible(engine, m: Manifest, root: str, module_only: bool = False,
                     optimizer_states: bool = True, strict: bool = True) -> None:
    """Names and shapes of every partitioned parameter and buffer must match; raises naming the first few that do not.
    Not strict: names on one side only are allowed (the model's keep their values), shapes must still match."""
    saved = {p.name: p for p in m.params}
    mine = {mp.name: mp for mp in engine.store.params}
    problems = []
    left_out = set(m.excluded_frozen)
    for name in sorted(left_out & mine.keys()):
        if mine[name].trainable and strict:
            problems.append(f"parameter {name} was frozen and left out when saved (exclude_frozen_parameters), so "
                            "the checkpoint has no weights for it; freeze it as it was, or load non-strictly to "
                            "keep its current values")
    missing = sorted(mine.keys() - saved.keys() - {n for n in left_out if n in mine and not mine[n].trainable})
    unexpected = sorted(saved.keys() - mine.keys())
    if strict:
        problems += [f"parameter {name} is not in the checkpoint" for name in missing]
        problems += [f"checkpoint parameter {name} is not in the model" for name in unexpected]
    elif missing and not mine.keys() & saved.keys():
        raise CheckpointError(f"checkpoint {root} has none of this model's parameters (the model has e.g. "
                              f"{missing[0]!r}, the checkpoint {unexpected[:1]}); a non-strict load would change "
                              "nothing, so check that the names match")
    elif missing or unexpected:
        warnings.warn(f"infinity: non-strict load of {root}: {len(missing)} parameters of the model are not in it and "
                      f"keep their values ({missing[:3]}), {len(unexpected)} of its parameters are not in the model "
                      f"and were skipped ({unexpected[:3]})", stacklevel=4)
    for name in mine.keys() & saved.keys():
        if mine[name].trainable and saved[name].frozen and not module_only and optimizer_states:
            problems.append(f"parameter {name} was frozen when saved, so the checkpoint has no optimizer state for "
                            "it; pass load_module_only=True, or freeze it (requires_grad=False) as it was")
        if list(mine[name].shape) != list(saved[name].shape):
            problems.append(f"parameter {name}: the checkpoint has shape {tuple(saved[name].shape)}, the model "
                            f"{tuple(mine[name].shape)}")
    extras = {e.name: e for e in m.extras}
    for name, t in extra_tensors(engine.module).items():
        e = extras.get(name)
        if e is None:
            if strict:
                problems.append(f"buffer {name} is not in the checkpoint")
        elif list(t.shape) != list(e.shape):
            problems.append(f"buffer {name}: the checkpoint has shape {tuple(e.shape)}, the model {tuple(t.shape)}")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CheckpointError(f"checkpoint {root} does not fit this model: " + "; ".join(sorted(problems)[:5]) + more)


def my_reads(engine, m: Manifest):
    """(managed param, saved entry, lo, hi, [(chunk index, first element, last element)]) for this rank, for every
    parameter the checkpoint has."""
    saved = {p.name: p for p in m.params}
    rank = engine.comm.rank
    for mp in engine.store.params:
        s = saved.get(mp.name)
        if s is None:  # a non-strict load: it keeps its current values
            continue
        lo, hi = rank * mp.part, min(mp.numel, (rank + 1) * mp.part)
        pieces = []
        pos = lo
        while pos < hi:
            c = pos // s.part
            end = min(hi, (c + 1) * s.part)
            pieces.append((c, pos, end))
            pos = end
        yield mp, s, lo, hi, pieces


def load(engine, directory, tag: str | None = None, *, verify: bool = True, module_only: bool = False,
         lr_scheduler: bool = True, optimizer_states: bool = True, strict: bool = True) -> tuple[str, object]:
    """See Engine.load_checkpoint and [Note: verify before load]."""
    comm = engine.comm
    root, m = _lookup(comm, directory, tag)
    states = STATES[:1] if module_only or not optimizer_states else STATES
    client_state = _client_state(m, root)
    apply = together(comm, "check", lambda: (check_compatible(engine, m, root, module_only, optimizer_states, strict),
                                             _prepare_restore(engine, m, root, module_only, lr_scheduler))[1])
    io = open_io(engine.config, root)
    reader = ChunkReader(io)
    try:
        if verify:
            together(comm, "verification", lambda: _verify(engine, m, root, reader, states))
        together(comm, "load", lambda: _load(engine, m, root, reader, states))
    finally:
        io.close()
    engine.store.refresh_persistent()  # collective: only once every rank has loaded
    apply()
    if not optimizer_states:  # fresh moments: Adam starts counting again, as DeepSpeed's re-created optimizer
        engine.restore_counters(optimizer_steps=0)
    return root, client_state


def _client_state(m: Manifest, root: str):
    if m.client_state_pickle is None:
        return m.client_state
    try:  # as torch.load(weights_only=False) would: a checkpoint is trusted input (see Engine.save_checkpoint)
        return pickle.loads(base64.b64decode(m.client_state_pickle))
    except Exception as exc:  # noqa: BLE001 - any failure means the stored bytes are unusable
        raise CheckpointError(f"checkpoint {root}: its client_state cannot be unpickled ({exc})") from None


def _lookup(comm, directory, tag):
    """Rank 0 resolves the tag (latest may move under a concurrent save) and tells the others."""
    out = err = None
    if comm.rank == 0:
        try:
            out = ("ok", resolve(directory, tag))
        except (CheckpointError, ValueError) as exc:
            err = exc
            out = ("error", type(exc).__name__, str(exc))
    out = comm.broadcast_object(out)
    if err is not None:
        raise err
    if out[0] == "error":
        kind = {"ValueError": ValueError, "NoLatest": NoLatest}.get(out[1], CheckpointError)
        raise kind(out[2])
    return out[1]


def _verify(engine, m: Manifest, root: str, reader: ChunkReader, states) -> None:
    chunks = {}
    for mp, s, lo, hi, pieces in my_reads(engine, m):
        for c, _, _ in pieces:
            for state in (states if mp.trainable else STATES[:1]):
                chunks.setdefault(chunk_path(root, state, mp.name, c),
                                  (m.itemsize(state) * s.part, f"{state} of parameter {mp.name}"))
    for e in m.extras:
        n = int(np.prod(e.shape, dtype=np.int64))
        if n:
            chunks[chunk_path(root, "extra", e.name, 0)] = (n * BY_NAME[e.dtype].itemsize, f"buffer {e.name}")
    reader.verify((path, n, what) for path, (n, what) in chunks.items())


def _load(engine, m: Manifest, root: str, reader: ChunkReader, states) -> None:
    """Weights (and, unless module_only, Adam's moments) and buffers into this rank's engine."""
    plan = {id(mp): (s, lo, hi, pieces) for mp, s, lo, hi, pieces in my_reads(engine, m)}
    moments = engine.optimizer.moments
    if m.moments_dtype != moments_name(moments) and any(st != STATES[0] for st in states):
        how = {torch.float32: "widened exactly", torch.bfloat16: "rounded to nearest even"}.get(
            moments, "encoded into 8-bit blocks, rounded to nearest")
        warnings.warn(f"load_checkpoint: {root} holds Adam moments in {m.moments_dtype}, this engine keeps them "
                      f"in {moments_name(moments)} (offload_optimizer.moments_dtype); they were converted ({how})",
                      stacklevel=3)

    def fill(g, p, mm, v):
        window = Window()
        converts = []  # (destination, what was read in the checkpoint's dtype), done once the reads land
        try:
            for mp, off, first, last in g.entries():  # the group holds elements [first, last) of mp's shard
                if id(mp) not in plan:  # not in the checkpoint (a non-strict load): its state stays
                    continue
                s, lo, hi, pieces = plan[id(mp)]
                lo, hi = lo + first, min(hi, lo + last)  # the global elements this group holds, padding cut
                for state, dest in zip(STATES, (p, mm, v)):
                    d = dest[off:off + last - first]
                    if state not in states:  # module_only / no optimizer states: fresh moments
                        d.zero_()
                        continue
                    d[max(0, hi - lo):].zero_()  # padding
                    saved = m.dtype_of(state)
                    if saved != d.dtype:
                        tmp = torch.empty(max(0, hi - lo), dtype=saved)
                        converts.append((d[:tmp.numel()], tmp))
                    size = saved.itemsize
                    for c, a, b in pieces:
                        a, b = max(a, lo), min(b, hi)
                        if a >= b:
                            continue
                        into = d if saved == d.dtype else tmp
                        reader.read_into(window, into[a - lo:b - lo], chunk_path(root, state, mp.name, c),
                                         size * (a - c * s.part))
        finally:
            window.finish()  # every read has landed (or failed) before the caller reuses these buffers
        for dest, tmp in converts:
            dest.copy_(tmp)

    partial = any(id(mp) not in plan for mp in engine.store.params if mp.trainable)
    changed = engine.optimizer.import_state(fill, refresh=False, keep_unfilled=partial)
    if changed and m.moments_dtype == moments_name(moments):  # 8-bit into 8-bit, other blocks
        warnings.warn(f"load_checkpoint: {changed:,} of this rank's Adam moment values changed when re-encoded into "
                      f"8-bit blocks: its sub-groups differ from those {root} was saved from (another world size "
                      "or sub_group_size), so values far below their new block's largest were rounded or became "
                      "zero; load with the saved layout, or with moments_dtype fp32, to keep them exactly",
                      stacklevel=3)
    for mp in engine.store.params:  # frozen ones: weights only, one shard at a time
        if mp.trainable or id(mp) not in plan:
            continue
        s, lo, hi, pieces = plan[id(mp)]
        shard = torch.zeros(mp.part, dtype=torch.float32)
        window = Window()
        try:
            for c, a, b in pieces:
                reader.read_into(window, shard[a - lo:b - lo], chunk_path(root, "master", mp.name, c),
                                 4 * (a - c * s.part))
        finally:
            window.finish()
        engine.store.write_shard(mp, shard, wait=True)
    current = extra_tensors(engine.module)
    for e in m.extras:
        t = current.get(e.name)
        if t is None or not t.numel():
            continue
        tmp = torch.empty(t.numel(), dtype=BY_NAME[e.dtype])
        window = Window()
        reader.read_into(window, tmp.view(torch.uint8), chunk_path(root, "extra", e.name, 0), 0)
        window.finish()
        t.copy_(tmp.view(t.shape))


def _prepare_restore(engine, m: Manifest, root: str, module_only: bool, lr_scheduler: bool):
    """Check everything besides the arrays that a load will apply, and return the function that applies it
    (after the arrays are in). Raises CheckpointError, with nothing changed, if any of it is unusable."""
    from infinity.engine.loss_scaler import LossScaler

    def fresh_optimizer():
        engine.restore_counters(optimizer_steps=0)
        engine.forget_gradients()

    if module_only:  # Adam starts afresh from the loaded weights; the engine's counters stay
        return fresh_optimizer
    e = m.engine
    try:
        counters = {k: int(e[k]) for k in ("global_steps", "skipped_steps", "micro_steps", "optimizer_steps")}
        lrs = [float(x) for x in e["lr"]]
        scaler = dict(e["loss_scaler"])
        unknown = set(scaler) - set(LossScaler.__slots__)
        if unknown:
            raise ValueError(f"unknown loss scaler fields {sorted(unknown)}")
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {root} is corrupted: its manifest's engine state is unusable ({exc})") \
            from None
    if len(lrs) != len(engine.optimizer.param_groups):
        raise CheckpointError(f"checkpoint {root} has {len(lrs)} optimizer param groups, the engine "
                              f"{len(engine.optimizer.param_groups)}")
    sched_state = None
    sched = engine.lr_scheduler
    if lr_scheduler and sched is not None and e.get("lr_scheduler") is not None:
        saved_type = e["lr_scheduler"].get("type")
        if saved_type != type(sched).__name__:
            raise CheckpointError(f"checkpoint {root}: its lr scheduler state is a {saved_type}'s, it does not fit "
                                  f"this engine's {type(sched).__name__}; pass load_lr_scheduler_states=False")
        sched_state = _decode_scheduler(e["lr_scheduler"], root)
        old = sched.state_dict()
        try:  # a trial, undone at once: the real load happens after the arrays
            sched.load_state_dict(sched_state)
        except Exception as exc:  # noqa: BLE001 - any failure means this state does not fit this scheduler
            raise CheckpointError(f"checkpoint {root}: its lr scheduler state does not fit this engine's "
                                  f"{type(sched).__name__} ({exc}); pass load_lr_scheduler_states=False") from None
        finally:
            sched.load_state_dict(old)
    rng = None
    rank_meta = os.path.join(root, "ranks", str(engine.comm.rank), "zarr.json")
    if engine.comm.world == m.world_size:  # RNG streams are per rank: only the same world continues them
        rng = _read_rng(rank_meta, root)
    use_scaler = bool(e.get("fp16")) and engine.config.fp16.enabled

    def apply():
        engine.restore_counters(global_steps=counters["global_steps"], skipped_steps=counters["skipped_steps"],
                                micro_steps=counters["micro_steps"], optimizer_steps=counters["optimizer_steps"])
        for g, lr in zip(engine.optimizer.param_groups, lrs):
            g["lr"] = lr
        if use_scaler:
            engine.scaler.load_state_dict(scaler)
        if sched_state is not None:
            sched.load_state_dict(sched_state)
        if rng is not None:
            restore_rng(rng)
        engine.forget_gradients()

    return apply


def _decode_scheduler(state: dict, root: str):
    if "json" in state:
        return state["json"]
    try:
        return pickle.loads(base64.b64decode(state["pickle"]))
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"checkpoint {root}: its lr scheduler state cannot be read ({exc})") from None


def _read_rng(path: str, root: str) -> dict:
    """This rank's RNG states, checked against their CRC-32C and tried (then undone) on the generators."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {root} is partial: {path} is missing")
    try:
        attrs = read_json(path)["attributes"]
        rng = attrs["rng"]
        ok = attrs.get("rng_crc32c") == crc_of(rng)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {root} is corrupted: {path} is unreadable ({exc})") from None
    if not ok:
        raise CheckpointError(f"checkpoint {root} is corrupted: {path} does not match the CRC-32C stored with it")
    old = rng_state()
    try:
        restore_rng(rng)
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"checkpoint {root}: the RNG states in {path} cannot be restored ({exc})") from None
    finally:
        restore_rng(old)
    return rng


def restore_rng(state: dict) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)
                                      for s in state["cuda"]])
