"""A training script written the way DeepSpeedExamples' are, with one change: the import.

    deepspeed --num_gpus 2 ds_train.py --deepspeed --deepspeed_config ds_config.json
becomes, on infinity:
    torchrun --nproc_per_node 2 ds_train.py --deepspeed --deepspeed_config ds_config.json

It trains a small causal LM on a synthetic token dataset, saves a checkpoint
mid-run with client_state, looks at weights with GatheredParameters, writes
the 16-bit model, then loads the checkpoint back and evaluates again. Rank 0
writes what it saw to --out (JSON) for the test that runs it.
"""

import argparse
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import infinity.deepspeed as deepspeed

VOCAB, SEQ, DIM = 64, 16, 32


def get_args():
    parser = argparse.ArgumentParser(description="toy causal LM")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--save_at", type=int, default=4, help="checkpoint after this many steps")
    parser.add_argument("--save_dir", type=str, required=True)
    parser.add_argument("--out", type=str, required=True)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class TokenDataset(torch.utils.data.Dataset):
    """Counting sequences with a stride: learnable, so the loss falls."""

    def __init__(self, n=128):
        g = torch.Generator().manual_seed(1234)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 5, (n, 1), generator=g)
        self.data = (start + stride * torch.arange(SEQ + 1)) % VOCAB

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i, :-1], self.data[i, 1:]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(DIM, VOCAB)
        for m in self.modules():  # the usual init loop in the top-level constructor
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def evaluate(engine, criterion):
    engine.eval()
    x, y = TokenDataset(8)[:]
    with torch.no_grad():
        loss = criterion(engine(x.to(engine.device)).float().reshape(-1, VOCAB), y.to(engine.device).reshape(-1))
    engine.train()
    return float(loss)


def main():
    args = get_args()
    deepspeed.init_distributed()
    with open(args.deepspeed_config) as f:
        ds_config = json.load(f)
    torch.manual_seed(42)
    with deepspeed.zero.Init(config_dict_or_path=ds_config,
                             enabled=ds_config["zero_optimization"]["stage"] == 3):
        model = Net()
    no_decay = ["bias", "ln.weight"]
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    model_engine, optimizer, trainloader, lr_scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=groups, training_data=TokenDataset())
    criterion = nn.CrossEntropyLoss()
    record = {"gas": model_engine.gradient_accumulation_steps(), "micro": model_engine.train_micro_batch_size_per_gpu(),
              "train_batch_size": model_engine.train_batch_size(), "losses": [], "lrs": [], "grad_norms": []}
    done = False
    while not done:
        for x, y in trainloader:
            x, y = x.to(model_engine.device), y.to(model_engine.device)
            loss = criterion(model_engine(x).float().view(-1, VOCAB), y.view(-1))
            model_engine.backward(loss)
            before = model_engine.global_steps
            model_engine.step()
            if model_engine.global_steps == before:
                continue
            record["losses"].append(loss.item())
            record["lrs"].append(model_engine.get_lr())
            record["grad_norms"].append(model_engine.get_global_grad_norm())
            if model_engine.global_steps == args.save_at:
                record["eval_saved"] = evaluate(model_engine, criterion)
                model_engine.save_checkpoint(args.save_dir, client_state={"step": args.save_at, "seen": (1, 2)})
            if model_engine.global_steps == args.steps:
                done = True
                break
    record["eval_end"] = evaluate(model_engine, criterion)
    with deepspeed.zero.GatheredParameters(list(model.head.parameters())):
        record["head_norm"] = float(model.head.weight.float().norm())
    record["saved_16bit"] = model_engine.save_16bit_model(args.save_dir, "model16.bin")
    _, client_state = model_engine.load_checkpoint(args.save_dir)
    record["client_state"] = repr(client_state)
    record["eval_loaded"] = evaluate(model_engine, criterion)
    record["global_steps_loaded"] = model_engine.global_steps
    record["global_samples_loaded"] = model_engine.global_samples
    if model_engine.global_rank == 0:
        with open(args.out, "w") as f:
            json.dump(record, f)
    assert all(math.isfinite(v) for v in record["losses"])


if __name__ == "__main__":
    main()
