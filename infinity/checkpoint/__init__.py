"""Checkpoints of partitioned, offloaded state as zarr v3 stores: streamed, atomic, reshardable.

save.py (engine.save_checkpoint), load.py (engine.load_checkpoint), export.py
(`infinity checkpoint export|info`), over layout.py (what is on disk) and
stream.py (chunk files through AsyncIO).
"""

from infinity.checkpoint.layout import CheckpointCorruptionError, CheckpointError

__all__ = ["CheckpointError", "CheckpointCorruptionError"]
