"""InfinityTrainer against transformers' own Trainer (no DeepSpeed): the same losses, lrs and gradient norms
over 10 optimizer steps with warmup, clipping and accumulation 2, on offload none, cpu and nvme; a bit-exact
resume from a Trainer checkpoint with save_total_limit rotation; save_model() loading with from_pretrained;
evaluate()/predict(); gradient checkpointing; LoRA; 2 ranks against 1; and each refusal's message."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (make deps installs it)")
pytest.importorskip("accelerate", reason="accelerate is not installed (make deps installs it)")

from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling,  # noqa: E402
                          Trainer, TrainingArguments)

from infinity.integrations.transformers import InfinityTrainer  # noqa: E402
from infinity.testing.parity import free_port  # noqa: E402
from infinity.testing.tiny_hf import make_model_dir  # noqa: E402

HERE = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(str(tmp_path_factory.mktemp("trainer") / "llama"), "llama")


class Rows(torch.utils.data.Dataset):
    """Token rows of one length (so per-rank means equal the global mean)."""

    def __init__(self, n=40, length=24, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.rows = [{"input_ids": torch.randint(10, 300, (length,), generator=g).tolist()} for _ in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def targs(out, **over):
    kw = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=10,
              learning_rate=2e-3, warmup_steps=3, max_grad_norm=0.5, logging_steps=1, report_to=[],
              save_strategy="no", seed=0, data_seed=0, use_cpu=True, optim="adamw_torch", weight_decay=0.01)
    kw.update(over)
    return TrainingArguments(**kw)


def zero3(tier, tmp_path):
    if tier == "none":
        return {"zero_optimization": {"stage": 3}}
    off = {"device": tier}
    if tier == "nvme":
        off["nvme_path"] = str(tmp_path / "nvme")
    return {"zero_optimization": {"stage": 3, "offload_optimizer": dict(off), "offload_param": dict(off)}}


def history(trainer):
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return ([h["loss"] for h in logs], [h["grad_norm"] for h in logs], [h["learning_rate"] for h in logs])


@pytest.fixture(scope="module")
def vanilla(model_dir, tmp_path_factory):
    """transformers' Trainer, plain torch AdamW, no DeepSpeed."""
    out = tmp_path_factory.mktemp("vanilla")
    tok = AutoTokenizer.from_pretrained(model_dir)
    t = Trainer(model=AutoModelForCausalLM.from_pretrained(model_dir), args=targs(out), train_dataset=Rows(),
                data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
    before = t.evaluate(Rows(8, seed=5))["eval_loss"]
    t.train()
    return {"history": history(t), "eval_before": before, "eval_after": t.evaluate(Rows(8, seed=5))["eval_loss"],
            "weights": {k: v.detach().clone() for k, v in t.model.state_dict().items()}}


def infinity_trainer(model_dir, out, cfg, **over):
    tok = AutoTokenizer.from_pretrained(model_dir)
    return InfinityTrainer(model=model_dir, args=targs(out, **over), train_dataset=Rows(), infinity_config=cfg,
                           data_collator=DataCollatorForLanguageModeling(tok, mlm=False), processing_class=tok)


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["none", "cpu", "nvme"])
def test_losses_lrs_and_norms_are_the_trainers(tier, model_dir, vanilla, tmp_path):
    t = infinity_trainer(model_dir, tmp_path / "out", zero3(tier, tmp_path))
    assert t.evaluate(Rows(8, seed=5))["eval_loss"] == pytest.approx(vanilla["eval_before"], rel=1e-6)
    t.train()
    losses, norms, lrs = history(t)
    want_losses, want_norms, want_lrs = vanilla["history"]
    assert len(losses) == 10
    assert losses == pytest.approx(want_losses, rel=1e-5)
    assert lrs == pytest.approx(want_lrs, rel=1e-12, abs=1e-15)
    assert norms == pytest.approx(want_norms, rel=1e-4), "the engine's pre-clip norm, as clip_grad_norm_ returns"
    assert t.evaluate(Rows(8, seed=5))["eval_loss"] == pytest.approx(vanilla["eval_after"], rel=1e-5)
    pred = t.predict(Rows(4, seed=6))
    assert pred.predictions.shape[:2] == (4, 24) and pred.metrics["test_loss"] > 0
    t.engine.close()


def test_resume_is_bit_exact_and_checkpoints_rotate(model_dir, tmp_path):
    cfg = zero3("nvme", tmp_path)
    whole = infinity_trainer(model_dir, tmp_path / "a", cfg, save_strategy="steps", save_steps=4, save_total_limit=2)
    whole.train()
    assert sorted(os.listdir(tmp_path / "a")) == ["checkpoint-10", "checkpoint-8"], "save_total_limit rotated"
    ckpt = tmp_path / "a" / "checkpoint-8"
    assert {"infinity", "scheduler.pt", "trainer_state.json", "model.safetensors", "config.json"} <= set(
        os.listdir(ckpt))
    whole_losses = history(whole)[0]
    final = {k: v.clone() for k, v in whole.engine.module_state_dict().items()}
    whole.engine.close()

    resumed = infinity_trainer(model_dir, tmp_path / "b", cfg, save_strategy="no")
    resumed.train(resume_from_checkpoint=str(ckpt))
    losses = history(resumed)[0]  # steps 1-8 from the checkpoint's trainer_state, then the two trained here
    assert len(losses) == 10 and losses[8:] == whole_losses[8:], "steps 9 and 10 are the uninterrupted run's"
    got = resumed.engine.module_state_dict()
    assert all(torch.equal(got[k], final[k]) for k in final)
    resumed.engine.close()


def test_save_model_loads_with_from_pretrained_and_equals_the_engine(model_dir, vanilla, tmp_path):
    t = infinity_trainer(model_dir, tmp_path / "out", zero3("cpu", tmp_path))
    t.train()
    t.save_model(str(tmp_path / "final"))
    engine_weights = t.engine.module_state_dict()
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))
    AutoTokenizer.from_pretrained(str(tmp_path / "final"))  # the tokenizer came along
    sd = loaded.state_dict()
    for k, v in engine_weights.items():
        assert torch.isfinite(sd[k]).all(), k
        assert torch.equal(sd[k], v), k
        assert torch.allclose(sd[k], vanilla["weights"][k], rtol=1e-4, atol=1e-6), k
    t.engine.close()


def test_a_config_scheduler_section_is_filled_from_the_arguments_and_drives_the_lr(model_dir, tmp_path):
    """DeepSpeed's WarmupDecayLR with "auto" everywhere: warmup from warmup_steps, total from max_steps, peak from
    learning_rate, as Hugging Face fills them; the logged lrs are DeepSpeed 0.19.8's sequence."""
    cfg = dict(zero3("cpu", tmp_path), scheduler={"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto",
        "warmup_type": "linear"}})
    t = infinity_trainer(model_dir, tmp_path / "out", cfg)
    t.train()
    lrs = history(t)[2]
    # 0.19.8: the first two steps both run at warmup_min_lr, then iteration k of 3 warmup steps, then linear decay
    gamma = [0.0, 0.0, 1 / 3, 2 / 3] + [(10 - k) / 7 for k in range(3, 9)]
    assert lrs == pytest.approx([2e-3 * g for g in gamma], rel=1e-9, abs=1e-15)
    t.engine.close()


def test_gradient_checkpointing_gives_the_same_losses(model_dir, vanilla, tmp_path):
    t = infinity_trainer(model_dir, tmp_path / "out", zero3("cpu", tmp_path), gradient_checkpointing=True)
    t.train()
    assert history(t)[0] == pytest.approx(vanilla["history"][0], rel=1e-5)
    t.engine.close()


def test_a_lora_model_trains_through_the_trainer(model_dir, tmp_path):
    peft = pytest.importorskip("peft", reason="peft is not installed (make deps installs it)")
    import infinity

    cfg = zero3("cpu", tmp_path)
    with infinity.zero_init(infinity.load_config(dict(cfg))):
        base = AutoModelForCausalLM.from_pretrained(model_dir)
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                     task_type="CAUSAL_LM"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    t = InfinityTrainer(model=model, args=targs(tmp_path / "out", learning_rate=2e-2, max_steps=12),
                        train_dataset=Rows(12, seed=1), infinity_config=cfg,
                        data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
    t.train()
    losses = history(t)[0]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.05, losses
    t.save_model(str(tmp_path / "adapter"))
    assert "adapter_model.safetensors" in os.listdir(tmp_path / "adapter")
    t.engine.close()


@pytest.mark.slow
def test_two_ranks_agree_with_one(model_dir, vanilla, tmp_path):
    """2 gloo ranks with per-device batch 1 train on the global batches one rank with batch 2 trains on."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), os.path.join(HERE, "trainer_script.py"), model_dir, str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rec = json.loads((tmp_path / "record.json").read_text())
    assert rec["world"] == 2
    assert rec["losses"] == pytest.approx(vanilla["history"][0], rel=1e-5)
    assert rec["lrs"] == pytest.approx(vanilla["history"][2], rel=1e-12, abs=1e-15)


def test_an_epoch_ending_in_a_short_accumulation_matches_the_trainer(model_dir, tmp_path):
    """21 micro-batches per epoch with accumulation 2: the epoch's last step has one micro-batch, which the loop
    marks as a boundary and normalises by its own count."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    common = dict(max_steps=-1, num_train_epochs=1)
    plain = Trainer(model=AutoModelForCausalLM.from_pretrained(model_dir), args=targs(tmp_path / "p", **common),
                    train_dataset=Rows(42), data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
    plain.train()
    ours = InfinityTrainer(model=model_dir, args=targs(tmp_path / "i", **common), train_dataset=Rows(42),
                           infinity_config=zero3("cpu", tmp_path),
                           data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
    ours.train()
    assert ours.state.global_step == plain.state.global_step == 11
    assert history(ours)[0] == pytest.approx(history(plain)[0], rel=1e-5)
    assert ours.engine.global_steps == 11
    ours.engine.close()


@pytest.mark.parametrize("over,message", [
    ({"after": {"deepspeed": {"zero_optimization": {"stage": 3}}}},
     "TrainingArguments.deepspeed=.* is not supported: InfinityTrainer is the engine; put the DeepSpeed config in "
     "infinity_config= instead"),
    ({"optim": "adafactor"}, "TrainingArguments.optim='adafactor' makes the optimizer Adafactor; the engine's "
                             "optimizer is Adam/AdamW"),
    ({"torch_compile": True}, "TrainingArguments.torch_compile=True is not supported"),
    ({"lr_scheduler_type": "reduce_lr_on_plateau", "eval_strategy": "steps"},
     "lr_scheduler_type='reduce_lr_on_plateau' is not supported "
                                                    r"\(it steps on evaluation metrics"),
    ({"bf16_full_eval": True}, "bf16_full_eval=True is not supported: evaluation runs in the engine's compute "
                               "dtype"),
    ({"load_best_model_at_end": True, "eval_strategy": "steps", "save_strategy": "steps"},
     "TrainingArguments.load_best_model_at_end=True is not supported"),
    # set after construction: TrainingArguments checks some of them against packages or launchers this
    # machine has not (liger-kernel, a parallel launch), and the refusal must not depend on that
    ({"after": {"enable_jit_checkpoint": True}}, "enable_jit_checkpoint=True is not supported: it saves between "
                                                 "backward and the optimizer step"),
    ({"after": {"parallelism_config": {"tp_size": 2}}}, "parallelism_config=.* is not supported: tensor/context "
                                                        "parallelism is not composed with the engine"),
    ({"after": {"save_on_each_node": True}}, "save_on_each_node=True is not supported: the engine's save writes "
                                             "from global rank 0 only"),
    ({"after": {"use_liger_kernel": True}}, "use_liger_kernel=True is not supported: Liger's kernels patch the "
                                            "model's modules"),
    ({"after": {"auto_find_batch_size": True}}, "auto_find_batch_size=True is not supported: the engine's batch "
                                                "sizes are fixed at build time"),
])
def test_arguments_it_cannot_honour_are_refused_by_name(over, message, model_dir, tmp_path):
    over = dict(over)
    after = over.pop("after", {})  # TrainingArguments(deepspeed=...) itself needs the deepspeed package
    args = targs(tmp_path / "out", **over)
    for k, v in after.items():
        setattr(args, k, v)
    with pytest.raises(ValueError, match=message):
        InfinityTrainer(model=model_dir, args=args, train_dataset=Rows(), infinity_config=zero3("none", tmp_path))


def test_config_and_training_arguments_disagreeing_is_an_error_naming_both(model_dir, tmp_path):
    cfg = dict(zero3("none", tmp_path), train_micro_batch_size_per_gpu=4, gradient_clipping=2.0,
               optimizer={"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.3}})
    with pytest.raises(ValueError) as err:
        infinity_trainer(model_dir, tmp_path / "out", cfg)
    text = str(err.value)
    for part in ("train_micro_batch_size_per_gpu=4 but TrainingArguments.per_device_train_batch_size=2",
                 "gradient_clipping=2.0 but TrainingArguments.max_grad_norm=0.5",
                 "optimizer.params.weight_decay=0.3 but TrainingArguments.weight_decay=0.01"):
        assert part in text, text
    assert "lr" not in text.replace("learning_rate", ""), "an \"auto\" lr is filled, not a mismatch"


def test_a_config_optimizer_section_must_describe_the_trainers_optimizer(model_dir, tmp_path):
    ok = dict(zero3("none", tmp_path), optimizer={"type": "Adam", "params": {"lr": "auto", "betas": "auto"}})
    t = infinity_trainer(model_dir, tmp_path / "a", ok)  # DeepSpeed's "Adam" is AdamW (adam_w_mode)
    t.engine.close()
    l2 = dict(zero3("none", tmp_path), optimizer={"type": "Adam", "params": {"adam_w_mode": False}})
    with pytest.raises(ValueError, match="optimizer is 'Adam' with adam_w_mode=False and TrainingArguments.optim "
                                         "makes AdamW"):
        infinity_trainer(model_dir, tmp_path / "b", l2)
    extra = dict(zero3("none", tmp_path), optimizer={"type": "AdamW", "params": {"bias_correction": False}})
    with pytest.raises(ValueError, match=r"optimizer.params \['bias_correction'\] would not be applied"):
        infinity_trainer(model_dir, tmp_path / "c", extra)


def test_a_client_optimizer_is_refused(model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with pytest.raises(ValueError, match="optimizers=/optimizer_cls_and_kwargs= are not supported"):
        InfinityTrainer(model=model, args=targs(tmp_path), infinity_config=zero3("none", tmp_path),
                        optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None))


def test_trls_sft_trainer_runs_on_the_engine_as_a_mixin(model_dir, tmp_path):
    """`class InfinitySFTTrainer(InfinityTrainer, SFTTrainer)` on a chat dataset: TRL's tokenising, chat template
    and completion masking, the engine's step; the losses are plain SFTTrainer's."""
    trl = pytest.importorskip("trl", reason="trl is not installed (make deps installs it)")
    from datasets import Dataset

    rows = [{"messages": [{"role": "user", "content": f"what is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]} for i in range(24)]
    tok = AutoTokenizer.from_pretrained(model_dir)

    def sft_args(out):
        return trl.SFTConfig(output_dir=str(out), max_steps=6, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, learning_rate=3e-3, warmup_steps=2, logging_steps=1,
                             report_to=[], save_strategy="no", use_cpu=True, max_length=64, seed=0, data_seed=0,
                             assistant_only_loss=False, gradient_checkpointing=False, bf16=False)

    plain = trl.SFTTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), args=sft_args(tmp_path / "p"),
                           train_dataset=Dataset.from_list(rows), processing_class=tok)
    plain.train()

    class InfinitySFTTrainer(InfinityTrainer, trl.SFTTrainer):
        pass

    ours = InfinitySFTTrainer(model=model_dir, args=sft_args(tmp_path / "i"), train_dataset=Dataset.from_list(rows),
                              processing_class=tok, infinity_config=zero3("cpu", tmp_path))
    ours.train()
    want, got = history(plain)[0], history(ours)[0]
    assert len(got) == 6 and got == pytest.approx(want, rel=1e-5)
    assert got[-1] < got[0] - 0.5
    ours.engine.close()


def test_tensorboard_logs_the_engines_losses(model_dir, tmp_path):
    """report_to=["tensorboard"]: the Trainer's TensorBoard callback writes an event file whose train/loss,
    train/learning_rate and train/grad_norm scalars are the ones in log_history, one per optimizer step."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (make deps installs it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logs = tmp_path / "out"  # the callback writes under output_dir/runs/
    t = infinity_trainer(model_dir, logs, zero3("cpu", tmp_path), max_steps=4, report_to=["tensorboard"])
    t.train()
    losses, norms, lrs = history(t)
    t.engine.close()
    runs = [os.path.join(d, f) for d, _, fs in os.walk(logs) for f in fs if f.startswith("events.out.tfevents")]
    assert runs, f"no event file under {logs}"
    acc = EventAccumulator(os.path.dirname(runs[0]))
    acc.Reload()
    scalars = {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert len(losses) == 4
    assert scalars["train/loss"] == pytest.approx(losses, rel=1e-6)
    assert scalars["train/learning_rate"] == pytest.approx(lrs, rel=1e-6)
    assert scalars["train/grad_norm"] == pytest.approx(norms, rel=1e-6)
