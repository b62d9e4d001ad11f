"""OffloadAdamW against torch.optim.AdamW in the loops people write: a plain loop with a scheduler and
clip_grad_norm_, parameters that skip steps, torch-layout state dicts both ways, a streamed save/load,
transformers' Trainer(optimizers=...), and DDP on 2 gloo ranks."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from infinity.optim import OffloadAdamW
from infinity.testing.parity import free_port

HERE = os.path.dirname(__file__)
VOCAB = 50


class TinyLM(nn.Module):
    """nanoGPT-shaped: token and position embeddings, one MLP block with a LayerNorm, a head."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, 16)
        self.wpe = nn.Embedding(16, 16)
        self.ln = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 64)
        self.proj = nn.Linear(64, 16)
        self.head = nn.Linear(16, VOCAB, bias=False)

    def forward(self, x):
        h = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        h = h + self.proj(F.gelu(self.fc(self.ln(h))))
        return self.head(h)


def groups(model):
    """The usual split: decay on matrices, none on biases, norms and embeddings."""
    plain = [p for n, p in model.named_parameters() if p.ndim < 2 or "wpe" in n]
    decay = [p for n, p in model.named_parameters() if not (p.ndim < 2 or "wpe" in n)]
    return [{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}]


def batch(g):
    x = torch.randint(0, VOCAB, (8, 13), generator=g)
    return x[:, :-1], x[:, 1:]


def train(make_opt, steps=20, *, freeze_fc_every=0, model=None, opt=None, start=0):
    torch.manual_seed(0)
    model = model or TinyLM()
    opt = opt or make_opt(groups(model))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5) * max(0.1, 1 - s / 40))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # fast-forwarding the schedule to where a resume starts
        for _ in range(start):
            sched.step()
    g = torch.Generator().manual_seed(1)
    for _ in range(start):
        batch(g)
    losses = []
    for s in range(start, steps):
        x, y = batch(g)
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        if freeze_fc_every and s % freeze_fc_every == 0:
            model.fc.weight.grad = None  # a parameter without a gradient this step: torch skips it
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model, opt


def torch_adamw(gs):
    return torch.optim.AdamW(gs, lr=3e-3, betas=(0.9, 0.95), eps=1e-8)


def offload(tier, tmp_path, **kw):
    # 3000: fc.weight (which skips steps) shares a sub-group with parameters that do not, so one sub-group
    # steps spans of different step counts
    extra = {"nvme_path": str(tmp_path / "nvme"), "sub_group_size": 3000} if tier == "nvme" else {}
    return lambda gs: OffloadAdamW(gs, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, offload=tier, **extra, **kw)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_a_plain_loop_matches_torch_adamw(tier, tmp_path):
    ref, ref_model, _ = train(torch_adamw, freeze_fc_every=3)
    got, model, opt = train(offload(tier, tmp_path), freeze_fc_every=3)
    assert got == pytest.approx(ref, rel=1e-5)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if tier == "nvme":
        assert len(opt.sub_groups) > 2 and os.listdir(tmp_path / "nvme" / "infinity-swap")
        # fp32 parameters in RAM are their own master: the files hold the two moments, 8 B per parameter
        for s in opt.sub_groups:
            assert s.state.io_bytes == 8 * s.numel and os.path.getsize(s.state.path) >= 8 * s.numel
        assert opt._swap.swapper.pool.size == 8 * max(s.numel for s in opt.sub_groups)
    opt.close()
    assert not list((tmp_path / "nvme").rglob("*.swp")), "close() removes the swap files"


def test_nvme_keeps_a_master_only_for_parameters_that_are_not_fp32_in_ram(tmp_path):
    """A bf16 layer beside fp32 ones: its sub-groups' files hold [master | m | v] (12 B per parameter), the fp32
    ones' the moments (8 B), the pool's buffers fit the larger; a step keeps each bf16 parameter the rounding
    of its fp32 master and moves the fp32 ones in place."""
    torch.manual_seed(0)
    model = TinyLM()
    model.fc.to(torch.bfloat16)
    opt = OffloadAdamW(model.parameters(), lr=1e-2, offload="nvme", nvme_path=str(tmp_path / "nvme"),
                       sub_group_size=1)
    for s in opt.sub_groups:
        want = 12 if s.params[0].dtype == torch.bfloat16 else 8
        assert s.state.io_bytes == want * s.numel, (s.params[0].dtype, s.state.io_bytes, s.numel)
    assert {s.params[0].dtype for s in opt.sub_groups} == {torch.float32, torch.bfloat16}
    assert opt._swap.swapper.pool.size >= 12 * max(s.numel for s in opt.sub_groups)
    before = model.head.weight.detach().clone()
    x, y = batch(torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1))
    loss.backward()
    opt.step()
    assert not torch.equal(model.head.weight, before), "the fp32 head was stepped in place"
    master = opt.state_dict()["state"][[id(p) for p in model.parameters()].index(id(model.fc.weight))]["master"]
    assert torch.equal(master.to(torch.bfloat16), model.fc.weight.detach())
    opt.close()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_state_dicts_load_both_ways_with_torch_adamw(tier, tmp_path):
    ref, _, _ = train(torch_adamw)
    # torch's state at step 10 continues here to torch's losses
    _, model, topt = train(torch_adamw, steps=10)
    opt = offload(tier, tmp_path)(groups(model))
    opt.load_state_dict(topt.state_dict())
    got, _, _ = train(None, model=model, opt=opt, start=10)
    assert got == pytest.approx(ref[10:], rel=1e-5)
    # and this optimizer's state continues in torch's
    sd = opt.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"} and float(sd["state"][0]["step"]) == 20
    fresh = torch_adamw(groups(model))
    fresh.load_state_dict(sd)
    assert fresh.state_dict()["state"][0]["exp_avg"].shape == sd["state"][0]["exp_avg"].shape
    opt.close()


def test_save_and_load_stream_and_resume_exactly(tmp_path):
    whole, _, _ = train(offload("cpu", tmp_path), steps=12)
    _, model, opt = train(offload("nvme", tmp_path), steps=6)
    opt.save(str(tmp_path / "ckpt"))
    assert sorted(os.listdir(tmp_path / "ckpt"))[-1] == "meta.json"
    opt.close()
    torch.manual_seed(123)
    model2 = TinyLM()  # other weights: load() gives the saved master values back
    opt2 = offload("nvme", tmp_path)(groups(model2))
    opt2.load(str(tmp_path / "ckpt"))
    for a, b in zip(model2.parameters(), model.parameters()):
        assert torch.equal(a, b)
    rest, _, _ = train(None, steps=12, model=model2, opt=opt2, start=6)
    assert rest == whole[6:]
    opt2.close()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_bf16_parameters_keep_an_fp32_master(tier, tmp_path):
    torch.manual_seed(0)
    model = TinyLM().to(torch.bfloat16)
    opt = OffloadAdamW(model.parameters(), lr=1e-2, offload=tier, nvme_path=str(tmp_path / "nvme"))
    g = torch.Generator().manual_seed(1)
    first = None
    for _ in range(15):
        x, y = batch(g)
        loss = F.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        first = first if first is not None else loss.item()
    assert loss.item() < first - 0.1  # random tokens: the unigram is what there is to learn
    sd = opt.state_dict()
    master = sd["state"][0]["master"]
    assert master.dtype == torch.float32
    assert torch.equal(master.to(torch.bfloat16), next(model.parameters()).detach()), \
        "the parameter is its master, rounded"
    opt.close()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_bf16_moments_are_opt_in_and_track_fp32(tier, tmp_path):
    """moments_dtype="bf16" stores exp_avg and exp_avg_sq in bf16 (8 bytes of state per parameter on NVMe
    instead of 12); the losses stay within 1e-3 of torch's fp32 AdamW over 20 steps."""
    ref, _, _ = train(torch_adamw)
    got, _, opt = train(offload(tier, tmp_path, moments_dtype="bf16"))
    assert got == pytest.approx(ref, rel=1e-3)
    assert got != pytest.approx(ref, rel=1e-7), "bf16 moments round: not the fp32 path"
    views = opt.sub_groups[0].state.open()
    assert views.exp_avg.dtype == torch.bfloat16
    opt.sub_groups[0].state.close(write=False)
    assert float(opt.state_dict()["state"][0]["step"]) == 20
    opt.close()


def test_bad_arguments_say_what_to_change(tmp_path):
    p = [nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="offload='gpu'; use 'cpu' or 'nvme'"):
        OffloadAdamW(p, offload="gpu")
    with pytest.raises(ValueError, match="offload='nvme' needs nvme_path="):
        OffloadAdamW(p, offload="nvme")
    with pytest.raises(ValueError, match="moments_dtype='fp8'"):
        OffloadAdamW(p, moments_dtype="fp8")
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        OffloadAdamW([{"params": p, "amsgrad": True}])
    opt = OffloadAdamW(p)
    with pytest.raises(NotImplementedError, match="build the optimizer with every group"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    with pytest.raises(FileNotFoundError, match="meta.json is missing"):
        opt.load(str(tmp_path))
    opt.close()
    with pytest.raises(RuntimeError, match="OffloadAdamW is closed"):
        opt.step()


def test_the_trainer_trains_with_it(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (make deps installs it)")
    pytest.importorskip("accelerate", reason="accelerate is not installed (make deps installs it)")

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lm = TinyLM()

        def forward(self, input_ids, labels=None):
            logits = self.lm(input_ids)
            return {"loss": F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)), "logits": logits}

    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": x, "labels": y} for x, y in zip(*batch(g))] * 4

    def run(opt_factory):
        model = Wrapped()
        opt = opt_factory(groups(model.lm))
        args = transformers.TrainingArguments(output_dir=str(tmp_path / "t"), per_device_train_batch_size=4,
                                              max_steps=8, logging_steps=1, report_to=[], save_strategy="no",
                                              use_cpu=True, max_grad_norm=0.5, seed=0, data_seed=0)
        t = transformers.Trainer(model=model, args=args, train_dataset=rows,
                                 optimizers=(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / 10)))
        t.train()
        return [h["loss"] for h in t.state.log_history if "loss" in h], opt

    ref, _ = run(torch_adamw)
    got, opt = run(offload("cpu", tmp_path))
    assert len(got) == 8 and got == pytest.approx(ref, rel=1e-5)
    opt.close()


@pytest.mark.slow
def test_ddp_on_two_ranks_matches_one_process_over_the_global_batch(tmp_path):
    ref, _, _ = train(torch_adamw, steps=8)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), os.path.join(HERE, "offload_ddp_script.py"), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    got = [float(v) for v in (tmp_path / "losses.txt").read_text().split()]
    assert got == pytest.approx(ref, rel=1e-5)
    assert not list(tmp_path.rglob("*.swp"))


@pytest.mark.slow
def test_lightning_trains_and_resumes_with_it(tmp_path):
    """A LightningModule whose configure_optimizers returns OffloadAdamW (nvme) with a per-step warmup schedule,
    under Lightning's Trainer with gradient_clip_val and accumulate_grad_batches: Lightning calls step(closure)
    with its clip inside the closure. The losses are torch AdamW's within 1e-5, and a run resumed from
    Lightning's own checkpoint (optimizer.state_dict() inside it) continues with the uninterrupted run's losses."""
    L = pytest.importorskip("lightning", reason="lightning is not installed (make deps installs it)")

    g = torch.Generator().manual_seed(1)
    data = [batch(g) for _ in range(32)]

    class LitLM(L.LightningModule):
        def __init__(self, kind):
            super().__init__()
            torch.manual_seed(0)
            self.lm = TinyLM()
            self.kind = kind
            self.losses = []

        def training_step(self, b, i):
            x, y = b
            loss = F.cross_entropy(self.lm(x).reshape(-1, VOCAB), y.reshape(-1))
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            if self.kind == "torch":
                opt = torch_adamw(groups(self.lm))
            else:
                opt = OffloadAdamW(groups(self.lm), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, offload="nvme",
                                   nvme_path=str(tmp_path / "nvme"), sub_group_size=3000)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def fit(kind, max_steps, ckpt=None, save=None, skip=0):
        lit = LitLM(kind)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, gradient_clip_val=0.5,
                            accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
        loader = torch.utils.data.DataLoader(data[skip:], batch_size=None, shuffle=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a list is not a resumable loader: the resume is given the rest
            trainer.fit(lit, loader, ckpt_path=ckpt)
        if save:
            trainer.save_checkpoint(save)
        opt = trainer.optimizers[0]
        if isinstance(opt, OffloadAdamW):
            opt.close()
        return lit.losses

    ref = fit("torch", 10)
    got = fit("offload", 10)
    assert len(got) == 20 and got == pytest.approx(ref, rel=1e-5)
    assert got[-1] < got[0]
    first = fit("offload", 6, save=str(tmp_path / "six.ckpt"))
    rest = fit("offload", 10, ckpt=str(tmp_path / "six.ckpt"), skip=12)
    assert first == got[:12] and rest == got[12:], "resumed from Lightning's checkpoint: the same losses"
