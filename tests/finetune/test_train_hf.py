"""`infinity train --model DIR --data FILE`, end to end, against Hugging Face's own code.

In a temp dir: a Llama-style and a GPT-2-style model saved with save_pretrained, a byte-level BPE tokenizer
trained there with `tokenizers` (with a chat template), and jsonl files of each shape. The run must load the
weights (its first loss equals plain transformers' loss of the pretrained weights on the same batch), make the
loss fall, and write a directory that AutoModelForCausalLM / AutoTokenizer load and generate from, with the
engine's weights bit for bit (fp32).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (make deps installs it)")
pytest.importorskip("datasets", reason="datasets is not installed (make deps installs it)")

from infinity.finetune import data as fdata  # noqa: E402
from infinity.testing.tiny_hf import make_model_dir, write_corpus  # noqa: E402

INFINITY = [sys.executable, "-m", "infinity"]
FP32_NVME = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 20000,
                                   "offload_param": {"device": "nvme", "buffer_count": 4, "buffer_size": 40000},
                                   "offload_optimizer": {"device": "nvme", "buffer_count": 3}},
             "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0}},
             "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": 4}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("ft")
    return {"llama": make_model_dir(str(root / "llama"), "llama"), "gpt2": make_model_dir(str(root / "gpt2"), "gpt2"),
            "text": write_corpus(str(root / "text.jsonl")),
            "chat": write_corpus(str(root / "chat.jsonl"), shape="chat", rows=60),
            "pc": write_corpus(str(root / "pc.jsonl"), shape="prompt/completion", rows=60), "root": root}


def config(tmp_path, **over) -> str:
    cfg = json.loads(json.dumps(FP32_NVME))
    cfg.update(over)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def train(*args, timeout=400, env=None):
    return subprocess.run(INFINITY + ["train", *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=os.path.dirname(os.path.abspath(__file__)))


def metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def first_batch_loss(model_dir, data, seq, micro, seed=0):
    """Plain transformers: the pretrained weights' loss on the batch the run takes first."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    w = fdata.windows(data, tok, seq)
    sched = fdata.Schedule(windows=len(w), micro=micro, world=1, accum=1, seed=seed)
    batch = fdata.micro_batch(w, sched.indices(0, 0, 0))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        return model(**batch).loss.item()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_fine_tune_a_pretrained_directory_on_nvme(arch, files, tmp_path, disk_dir):
    run = tmp_path / "run"
    out = train("--model", files[arch], "--data", files["text"], "--config", config(tmp_path), "--steps", "8",
                "--seq", "64", "--nvme-path", str(disk_dir), "--out", str(run))
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"pretrained weights from {files[arch]}" in out.stdout
    assert f"data: {files['text']} (text," in out.stdout
    rows = metrics(run)
    want = first_batch_loss(files[arch], files["text"], 64, 4)
    assert abs(rows[0]["loss"] - want) <= 1e-5 * abs(want), (rows[0]["loss"], want)
    assert sum(r["loss"] for r in rows[-3:]) / 3 < rows[0]["loss"] - 0.2
    assert all(r["data_s"] >= 0 for r in rows)
    final = run / "final"
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(os.listdir(final))
    model = transformers.AutoModelForCausalLM.from_pretrained(final)
    tok = transformers.AutoTokenizer.from_pretrained(final)
    ids = tok("The quiet river", return_tensors="pt")["input_ids"]
    gen = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert gen.shape[1] == ids.shape[1] + 5
    assert not (disk_dir / "infinity-swap").exists() or not any((disk_dir / "infinity-swap").rglob("*.swp"))


def test_exported_weights_are_the_engines_bit_for_bit(files, tmp_path, disk_dir):
    """The engine in-process: train, save_pretrained, and compare the gathered fp32 values with the files."""
    from infinity.engine import gathered_parameters, initialize, zero_init
    from infinity.testing.parity import engine_config

    cfg = engine_config("nvme", str(disk_dir), **{"zero_optimization.offload_param.buffer_size": 40000,
                                                   "zero_optimization.sub_group_size": 20000})
    with zero_init(cfg):
        model = transformers.AutoModelForCausalLM.from_pretrained(files["gpt2"])
    tok = transformers.AutoTokenizer.from_pretrained(files["gpt2"])
    with initialize(model, cfg) as engine:
        x = torch.randint(0, len(tok), (4, 32), generator=torch.Generator().manual_seed(0))
        for _ in range(3):
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
        files_written = engine.save_pretrained(tmp_path / "out", tokenizer=tok, max_shard_size="60KB")
        with gathered_parameters(model):
            want = {k: v.clone() for k, v in model.state_dict().items()}
    assert "model.safetensors.index.json" in files_written and "tokenizer.json" in files_written
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    assert set(back) == set(want)
    for k in want:
        assert torch.equal(back[k], want[k]), k


def test_chat_labels_cover_exactly_the_assistant_tokens(files):
    tok = transformers.AutoTokenizer.from_pretrained(files["llama"])
    with open(files["chat"]) as f:
        rows = [json.loads(line) for line in f][:10]
    for i, row in enumerate(rows):
        ids, labels = fdata.chat_tokens(tok, row["messages"], row=i, path="chat")
        spans, cur = [], []
        for t, lab in zip(ids, labels):
            if lab != fdata.IGNORE:
                assert lab == t
                cur.append(t)
            elif cur:
                spans.append(cur)
                cur = []
        if cur:
            spans.append(cur)
        answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert [tok.decode(s) for s in spans] == [a + "<|end|>" for a in answers]


@pytest.mark.slow
def test_prompt_completion_masks_the_prompt(files):
    tok = transformers.AutoTokenizer.from_pretrained(files["llama"])
    w = fdata.windows(files["pc"], tok, 128)
    assert w.shape == "prompt/completion" and not w.packed
    row = json.loads(open(files["pc"]).readline())
    first = w.dataset[0]
    kept = [int(t) for t, lab in zip(first["input_ids"], first["labels"]) if lab != fdata.IGNORE]
    assert tok.decode(kept) == row["completion"] + "<|end|>"
    prompt = tok(row["prompt"])["input_ids"]
    assert first["input_ids"][:len(prompt)].tolist() == prompt and (first["labels"][:len(prompt)] == -100).all()
    assert int(first["attention_mask"].sum()) == len(prompt) + len(kept)


@pytest.mark.slow
def test_chat_fine_tune_on_two_ranks_matches_one_rank(files, tmp_path, disk_dir):
    """Each rank takes its share of every global batch: 1 x 4 and 2 x 2 see the same windows per step."""
    losses = {}
    for nproc, micro in ((1, 4), (2, 2)):
        run = tmp_path / f"run{nproc}"
        out = train("--model", files["llama"], "--data", files["chat"], "--config", config(tmp_path), "--steps", "3",
                    "--seq", "128", "--micro-batch", str(micro), "--nproc", str(nproc), "--nvme-path",
                    str(disk_dir / f"n{nproc}"), "--out", str(run))
        assert out.returncode == 0, out.stderr[-3000:]
        losses[nproc] = [r["loss"] for r in metrics(run)]
    assert "padded" in out.stdout and "chat" in out.stdout
    # The loss of each rank's half is averaged: equal per-rank weights, so 2 ranks agree to rounding only
    # where both halves hold the same number of assistant tokens; the first step's loss, before any update,
    # must agree to fp32 rounding of the mean of two means against one mean of the same tokens.
    assert abs(losses[1][0] - losses[2][0]) < 0.05 * losses[1][0]
    assert losses[2][-1] < losses[2][0]


@pytest.mark.slow
def test_lora_bf16_with_partitioned_adapters_trains_and_exports(files, tmp_path, disk_dir):
    peft = pytest.importorskip("peft", reason="peft is not installed (make deps installs it)")
    cfg = config(tmp_path, bf16={"enabled": True})
    run = tmp_path / "run"
    out = train("--model", files["llama"], "--data", files["text"], "--config", cfg, "--steps", "6", "--seq", "64",
                "--lora", "r=32,alpha=64,targets=q_proj,v_proj", "--nvme-path", str(disk_dir), "--out", str(run))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = metrics(run)
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(run / "final"))
    base = transformers.AutoModelForCausalLM.from_pretrained(files["llama"])
    model = peft.PeftModel.from_pretrained(base, run / "final")
    b = model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight
    assert b.abs().sum() > 0, "lora_B starts at zero: a trained adapter has moved it"


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_ctrl_c_leaves_no_swap_files_and_says_where_it_stopped(nproc, files, tmp_path, disk_dir):
    """Ctrl-C in a terminal signals the whole foreground process group: the launcher and every rank."""
    nvme = disk_dir / "swap"
    proc = subprocess.Popen(INFINITY + ["train", "--model", files["llama"], "--data", files["text"], "--config",
                                        config(tmp_path), "--steps", "100000", "--seq", "64", "--nvme-path",
                                        str(nvme), "--out", str(tmp_path / "run"), "--nproc", str(nproc)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and not (tmp_path / "run" / "metrics.jsonl").exists():
        time.sleep(0.2)
    while time.time() < deadline and not (tmp_path / "run" / "metrics.jsonl").read_text():
        time.sleep(0.2)
    assert any(nvme.rglob("*.swp")), "swap files exist while it trains"
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr
    lines = [ln for ln in stderr.splitlines() if ln.startswith("infinity train: interrupted at step")]
    assert len(lines) == nproc, stderr[-2000:]
    assert all("last checkpoint: none; swap files removed" in ln for ln in lines)
    assert not any(nvme.rglob("*.swp"))


@pytest.mark.slow
def test_a_non_finite_loss_stops_the_run_naming_the_step_and_lr(files, tmp_path, disk_dir):
    out = train("--model", files["gpt2"], "--data", files["text"], "--config", config(tmp_path), "--steps", "20",
                "--seq", "64", "--lr", "1e9", "--nvme-path", str(disk_dir), "--out", str(tmp_path / "run"))
    assert out.returncode == 1, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert "training diverged" in out.stderr and "(lr 1000000000.0)" in out.stderr and "at step" in out.stderr


@pytest.mark.parametrize("args,message", [
    (["--data", "nope.jsonl"], "--data nope.jsonl: no such file or directory"),
    (["--data", "{root}/bad.csvx"], "cannot tell the format from '.csvx'"),
    (["--data", "{root}/cols.jsonl"], "rows have columns ['body']; expected a 'text' column"),
    (["--lora", "r=4,rank=3"], "--lora: unknown key 'rank'"),
])
def test_bad_data_and_lora_input_is_one_clear_line(files, tmp_path, args, message, capsys):
    """In this process, through the CLI's own entry point (what `infinity train` runs): the error surfaces before
    any rank or engine exists, so a subprocess per message would only add interpreter start-ups."""
    from infinity.tools.cli import main

    root = files["root"]
    (root / "bad.csvx").write_text("x")
    (root / "cols.jsonl").write_text('{"body": "x"}\n')
    args = [a.format(root=root) for a in args]
    rc = main(["train", "--model", files["llama"], *args, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2, err[-2000:]
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("world,micro,accum", [(1, 4, 1), (2, 2, 1), (2, 3, 2), (3, 1, 4)])
def test_schedule_gives_every_rank_disjoint_windows_covering_each_step(world, micro, accum):
    sched = fdata.Schedule(windows=100, micro=micro, world=world, accum=accum, seed=3)
    for step in range(2 * sched.steps_per_epoch):
        got = [i for r in range(world) for k in range(accum) for i in sched.indices(step, r, k)]
        assert len(got) == len(set(got)) == sched.per_step
    epoch = [i for s in range(sched.steps_per_epoch) for r in range(world) for k in range(accum)
             for i in sched.indices(s, r, k)]
    assert len(set(epoch)) == len(epoch) == sched.steps_per_epoch * sched.per_step


@pytest.mark.slow
def test_eval_in_the_metrics_and_resume_refuses_another_data_order(files, tmp_path, disk_dir):
    common = ["--model", files["gpt2"], "--data", files["text"], "--config", config(tmp_path), "--seq", "64",
              "--eval-fraction", "0.1", "--nvme-path", str(disk_dir), "--save-dir", str(tmp_path / "ck")]
    out = train(*common, "--steps", "2", "--eval-every", "1", "--out", str(tmp_path / "a"))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = metrics(tmp_path / "a")
    assert all("eval_loss" in r and r["eval_loss"] > 0 for r in rows)
    assert rows[0]["lr"] == 3e-3
    again = train(*common, "--steps", "4", "--resume", "--seed", "5", "--out", str(tmp_path / "b"))
    assert again.returncode == 2
    assert "was saved by a run with seed 0 (now 5); resume with the same settings" in again.stderr


def test_one_rank_stops_between_steps_too(capfd):
    """[Note: Ctrl-C stops between steps] with one rank: the first signal only asks (a KeyboardInterrupt raised
    wherever the main thread is can wedge the swap reapers' queues), check() raises it at the step's end, and a
    second signal stops at once."""
    import signal as sig

    from infinity.tools import train as tr

    class Comm:
        world, rank = 1, 0

        def all_reduce_(self, t, op=None):
            raise AssertionError("one rank has nobody to agree with")

    with tr.StopBetweenSteps(Comm()) as stop:
        assert sig.getsignal(sig.SIGINT) == stop._on_signal, "one rank installs the handler too"
        stop.check()
        stop._on_signal(sig.SIGTERM, None)
        assert "stopping after this step" in capfd.readouterr().err
        with pytest.raises(tr.Terminated):
            stop.check()
        with pytest.raises(KeyboardInterrupt):
            stop._on_signal(sig.SIGTERM, None)  # again at once: no launcher repeats a signal to one rank
    assert sig.getsignal(sig.SIGINT) != stop._on_signal, "the handler goes when the loop ends"


def test_a_second_signal_stops_at_once_and_a_repeat_of_the_first_does_not(monkeypatch, capfd):
    """StopBetweenSteps on rank 0 of 2 (its handler called as the signal would call it): the first SIGINT asks
    for a stop after the step, the same signal again within REPEAT_S is that one arriving twice, a later one
    (or another signal) stops at once, and check() raises the agreed stop on every rank."""
    import signal as sig

    from infinity.tools import train as tr

    class Comm:
        world, rank = 2, 0

        def all_reduce_(self, t, op=None):
            t.fill_(max(int(t.item()), self.other))

    clock = [100.0]
    monkeypatch.setattr(tr.time, "monotonic", lambda: clock[0])
    comm = Comm()
    comm.other = 0
    stop = tr.StopBetweenSteps(comm)
    stop.check()  # nobody asked: returns
    stop._on_signal(sig.SIGINT, None)
    assert "stopping after this step (send the signal again to stop now)" in capfd.readouterr().err
    clock[0] += 0.5
    stop._on_signal(sig.SIGINT, None)  # the same Ctrl-C reaching this rank a second way: nothing
    with pytest.raises(KeyboardInterrupt) as first:
        stop.check()
    assert type(first.value) is KeyboardInterrupt
    clock[0] += tr.StopBetweenSteps.REPEAT_S
    with pytest.raises(KeyboardInterrupt):
        stop._on_signal(sig.SIGINT, None)  # pressed again: now
    with pytest.raises(tr.Terminated):
        stop._on_signal(sig.SIGTERM, None)  # another signal after the first: now, whatever the interval
    other = tr.StopBetweenSteps(comm)
    comm.other = int(sig.SIGTERM)  # the other rank was asked to stop: this one stops with it, as SIGTERM
    with pytest.raises(tr.Terminated):
        other.check()
