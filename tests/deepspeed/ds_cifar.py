"""A CIFAR-10 CNN script written the way DeepSpeedExamples' cifar10_deepspeed.py is, with one change: the
import. No torchvision here, so the dataset is a stand-in with CIFAR's shapes (3x32x32 images, 10 classes,
each class a fixed pattern plus noise); the script is otherwise that tutorial's: the config holds
train_batch_size only (the micro batch follows from it and the world size), fp16 with a dynamic loss scale,
WarmupLR, gradient_clipping, training_data for the engine's data loader, and inputs cast to the engine's
dtype by what bfloat16_enabled()/fp16_enabled() say.

Rank 0 writes what it saw to --out (JSON) for the test that runs it.
"""

import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import infinity.deepspeed as deepspeed
from infinity.deepspeed.accelerator import get_accelerator
from infinity.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("-e", "--epochs", default=2, type=int, help="number of total epochs (default: 2)")
    parser.add_argument("--log-interval", type=int, default=2000, help="output logging information at a given interval")
    parser.add_argument("--dtype", default="fp16", type=str, choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--stage", default=0, type=int, choices=[0, 1, 2, 3])
    parser.add_argument("--offload", default="none", choices=["none", "cpu", "nvme"])
    parser.add_argument("--nvme_path", default=None)
    parser.add_argument("--moe-param-group", default=False, action="store_true")
    parser.add_argument("--out", required=True)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class CifarLike(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        patterns = torch.randn(10, 3, 32, 32, generator=torch.Generator().manual_seed(7))
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 10, (n,), generator=g)
        self.images = (patterns[self.labels] + 0.7 * torch.randn(n, 3, 32, 32, generator=g)) / 2

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], int(self.labels[i])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def create_moe_param_groups(model):
    parameters = {"params": [p for p in model.parameters()], "name": "parameters"}
    return split_params_into_different_moe_groups_for_optimizer(parameters)


def get_ds_config(args):
    ds_config = {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {"type": "Adam",
                      "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                     "warmup_num_steps": 1000}},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16", "fp16_master_weights_and_grads": False, "loss_scale": 0,
                 "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": args.stage, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                              "overlap_comm": True, "contiguous_gradients": True, "cpu_offload": False},
    }
    if args.offload != "none":
        offload = {"device": args.offload}
        if args.offload == "nvme":
            offload["nvme_path"] = args.nvme_path
        ds_config["zero_optimization"]["offload_optimizer"] = dict(offload)
        if args.stage == 3:
            ds_config["zero_optimization"]["offload_param"] = dict(offload)
    return ds_config


def test(model_engine, testset, local_device, target_dtype):
    testloader = torch.utils.data.DataLoader(testset, batch_size=4, shuffle=False, num_workers=0)
    correct = total = 0
    model_engine.eval()
    with torch.no_grad():
        for images, labels in testloader:
            if target_dtype is not None:
                images = images.to(target_dtype)
            outputs = model_engine(images.to(local_device))
            _, predicted = torch.max(outputs.data, 1)
            total += labels.size(0)
            correct += (predicted == labels.to(predicted.device)).sum().item()
    return correct / total


def main(args):
    deepspeed.init_distributed()
    torch.manual_seed(0)
    trainset, testset = CifarLike(384, seed=1), CifarLike(80, seed=2)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    if args.moe_param_group:
        parameters = create_moe_param_groups(net)
    ds_config = get_ds_config(args)
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset, config=ds_config)
    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half
    criterion = nn.CrossEntropyLoss()
    record = {"micro": model_engine.train_micro_batch_size_per_gpu(), "gas": model_engine.gradient_accumulation_steps(),
              "fp16": model_engine.fp16_enabled(), "bf16": model_engine.bfloat16_enabled(), "losses": [], "lrs": [],
              "world": torch.distributed.get_world_size(), "acc_before": test(model_engine, testset, local_device,
                                                                                target_dtype)}
    model_engine.train()
    for epoch in range(args.epochs):
        running_loss = 0.0
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            record["lrs"].append(model_engine.get_lr()[0])
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            running_loss += loss.item()
            record["losses"].append(loss.item())
            if local_rank == 0 and i % args.log_interval == (args.log_interval - 1):
                print(f"[{epoch + 1 : d}, {i + 1 : 5d}] loss: {running_loss / args.log_interval : .3f}")
                running_loss = 0.0
    record["acc_after"] = test(model_engine, testset, local_device, target_dtype)
    record["steps"] = model_engine.global_steps
    record["skipped"] = model_engine.skipped_steps
    if model_engine.global_rank == 0:
        with open(args.out, "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    main(add_argument())
