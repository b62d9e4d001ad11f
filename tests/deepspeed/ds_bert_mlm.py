"""A BERT-style masked-LM pretraining script written the way DeepSpeedExamples' HelloDeepSpeed
(train_bert_ds.py) is, with one change: the import.

It builds a RoBERTa encoder plus LM head from a transformers config (no pretrained weights), masks tokens
as BERT does (80 % mask token, 10 % random, 10 % unchanged), trains with a micro-batch-only config, saves a
checkpoint every --checkpoint_every steps with client_state={'checkpoint_step': step}, and, given
--load_checkpoint_dir, resumes from the latest checkpoint there at checkpoint_step + 1. Batches are a
function of the step (seeded by it), so a resumed run sees the batches the uninterrupted run saw.

Rank 0 writes {step: loss} and run facts to --out (JSON) for the test that runs it; every run ends with the
engine's 16-bit weights in <exp_dir>/final/.
"""

import argparse
import json
import logging
import os
import pathlib

import torch
import torch.nn as nn
from transformers import RobertaConfig, RobertaModel
from transformers.models.roberta.modeling_roberta import RobertaLMHead

import infinity.deepspeed as deepspeed
from infinity.deepspeed.accelerator import get_accelerator
from infinity.deepspeed.utils import log_dist

VOCAB, PAD, MASK, SPECIAL = 96, 1, 4, 5  # ids below SPECIAL are <s>, <pad>, </s>, <unk>, <mask>


def is_rank_0() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def masking_function(tokens, generator, mask_prob=0.15, random_replace_prob=0.1, unmask_replace_prob=0.1):
    """BERT's masking: choose mask_prob of the real tokens as targets; of those, replace 80 % with <mask>,
    10 % with a random token and leave 10 %. Targets elsewhere are the pad id, which the loss ignores."""
    real = tokens != PAD
    chosen = (torch.rand(tokens.shape, generator=generator) < mask_prob) & real
    targets = torch.where(chosen, tokens, torch.full_like(tokens, PAD))
    roll = torch.rand(tokens.shape, generator=generator)
    src = tokens.clone()
    src[chosen & (roll < 1 - random_replace_prob - unmask_replace_prob)] = MASK
    rand_pos = chosen & (roll >= 1 - random_replace_prob - unmask_replace_prob) & (roll < 1 - unmask_replace_prob)
    src[rand_pos] = torch.randint(SPECIAL, VOCAB, (int(rand_pos.sum()),), generator=generator)
    return src, targets


def create_batch(step, batch_size, max_seq_length, rank, world):
    """Text stand-in: arithmetic token sequences (learnable), padded to random lengths; seeded by the step and
    the rank, so the data does not depend on where a run started."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(SPECIAL, VOCAB, (batch_size, 1), generator=g)
    stride = torch.randint(1, 4, (batch_size, 1), generator=g)
    tokens = SPECIAL + (start - SPECIAL + stride * torch.arange(max_seq_length)) % (VOCAB - SPECIAL)
    lengths = torch.randint(max_seq_length // 2, max_seq_length + 1, (batch_size, 1), generator=g)
    tokens = torch.where(torch.arange(max_seq_length) < lengths, tokens, torch.full_like(tokens, PAD))
    src, tgt = masking_function(tokens, g)
    return {"src_tokens": src, "tgt_tokens": tgt, "attention_mask": (tokens != PAD).long()}


class RobertaMLMModel(nn.Module):
    """Encoder plus LM head; forward returns the masked-LM loss (HelloDeepSpeed's shape)."""

    def __init__(self, config, encoder):
        super().__init__()
        self.config = config
        self.encoder = encoder
        self.lm_head = RobertaLMHead(config)

    def forward(self, src_tokens, attention_mask, tgt_tokens):
        hidden = self.encoder(input_ids=src_tokens, attention_mask=attention_mask).last_hidden_state
        logits = self.lm_head(hidden)
        return nn.functional.cross_entropy(logits.float().view(-1, self.config.vocab_size), tgt_tokens.view(-1),
                                           ignore_index=PAD)


def create_model(num_layers, num_heads, ff_dim, h_dim, dropout):
    config = RobertaConfig(vocab_size=VOCAB, hidden_size=h_dim, num_hidden_layers=num_layers,
                           num_attention_heads=num_heads, intermediate_size=ff_dim, hidden_dropout_prob=dropout,
                           attention_probs_dropout_prob=dropout, max_position_embeddings=64, pad_token_id=PAD)
    encoder = RobertaModel(config, add_pooling_layer=False)
    return RobertaMLMModel(config, encoder)


def train(args):
    device = (torch.device(get_accelerator().device_name(), args.local_rank)
              if args.local_rank > -1 and get_accelerator().is_available() else torch.device("cpu"))
    if args.checkpoint_dir:
        exp_dir = pathlib.Path(args.checkpoint_dir)
        exp_dir.mkdir(exist_ok=True)
    else:
        exp_dir = pathlib.Path(args.load_checkpoint_dir)
        assert exp_dir.exists()
    log_dist("Creating Model", ranks=[0], level=logging.INFO)
    model = create_model(args.num_layers, args.num_heads, args.ff_dim, args.h_dim, args.dropout)
    offload = {"device": args.offload}
    if args.offload == "nvme":
        offload["nvme_path"] = args.nvme_path
    ds_config = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": args.zero_stage, "offload_optimizer": offload},
    }
    if args.zero_stage == 3:  # the 16-bit model at the end is gathered from the partitions
        ds_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
        if args.offload != "none":
            ds_config["zero_optimization"]["offload_param"] = dict(offload)
    model, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    log_dist("DeepSpeed engine created", ranks=[0], level=logging.INFO)
    start_step = 1
    if args.load_checkpoint_dir is not None:
        _, client_state = model.load_checkpoint(load_dir=args.load_checkpoint_dir)
        checkpoint_step = client_state["checkpoint_step"]
        start_step = checkpoint_step + 1
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    log_dist(f"Total number of model parameters: {sum([p.numel() for p in model.parameters()]):,d}", ranks=[0])
    model.train()
    losses = {}
    step = start_step
    for step in range(start_step, args.num_iterations + 1):
        batch = create_batch(step, args.batch_size, args.max_seq_length, rank, world)
        for key, value in batch.items():
            batch[key] = value.to(device)
        loss = model(**batch)
        model.backward(loss)
        model.step()
        losses[step] = loss.item()
        if step % args.checkpoint_every == 0:
            model.save_checkpoint(save_dir=exp_dir, client_state={"checkpoint_step": step})
            log_dist(f"Saved model to {exp_dir}", ranks=[0])
    model.save_16bit_model(str(exp_dir / "final"), "pytorch_model.bin")
    if is_rank_0():
        with open(args.out, "w") as f:
            json.dump({"start_step": start_step, "losses": losses, "world": world,
                       "params": sum(p.numel() for p in model.parameters()),
                       "ds_params": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())}, f)
    return exp_dir


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint_dir", default=None)
    parser.add_argument("--load_checkpoint_dir", default=None)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--num_heads", type=int, default=2)
    parser.add_argument("--ff_dim", type=int, default=128)
    parser.add_argument("--h_dim", type=int, default=64)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--max_seq_length", type=int, default=32)
    parser.add_argument("--num_iterations", type=int, default=10)
    parser.add_argument("--checkpoint_every", type=int, default=4)
    parser.add_argument("--zero_stage", type=int, default=1)
    parser.add_argument("--offload", default="cpu")
    parser.add_argument("--nvme_path", default=None)
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", -1)))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if (args.checkpoint_dir is None) == (args.load_checkpoint_dir is None):
        parser.error("give one of --checkpoint_dir or --load_checkpoint_dir")
    return args


if __name__ == "__main__":
    torch.manual_seed(42)
    train(get_args())
