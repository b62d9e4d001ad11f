"""InfinityTrainer under torchrun (run by test_trainer.test_two_ranks_agree_with_one): per-device batch 1 on
each of the ranks, ZeRO-3 with CPU offload; rank 0 writes the logged losses and lrs to <out>/record.json."""

import json
import os
import sys

import torch
from transformers import AutoTokenizer, DataCollatorForLanguageModeling

from infinity.integrations.transformers import InfinityTrainer

sys.path.insert(0, os.path.dirname(__file__))
from test_trainer import Rows, targs  # noqa: E402

model_dir, out = sys.argv[1], sys.argv[2]
tok = AutoTokenizer.from_pretrained(model_dir)
cfg = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
trainer = InfinityTrainer(model=model_dir, args=targs(os.path.join(out, "run"), per_device_train_batch_size=1),
                          train_dataset=Rows(), infinity_config=cfg,
                          data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
trainer.train()
logs = [h for h in trainer.state.log_history if "loss" in h]
if torch.distributed.get_rank() == 0:
    with open(os.path.join(out, "record.json"), "w") as f:
        json.dump({"world": torch.distributed.get_world_size(), "losses": [h["loss"] for h in logs],
                   "lrs": [h["learning_rate"] for h in logs]}, f)
trainer.engine.close()
