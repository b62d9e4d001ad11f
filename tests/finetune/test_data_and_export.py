"""The rest of the fine-tuning path, against `datasets`, `transformers` and `peft` themselves.

- `--data` in every format gives the same windows as the jsonl of the same rows, prepared once (in a child
  process) and then reused from the cache entry;
- `--epochs` runs each window once per epoch;
- a LoRA run's merged model (`--merge-lora`), its checkpoint's adapter export and its merged export agree
  with peft's own `merge_and_unload`;
- SIGTERM sent to the launcher alone (a scheduler's `kill`) stops every rank and leaves no swap files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (make deps installs it)")
datasets = pytest.importorskip("datasets", reason="datasets is not installed (make deps installs it)")

from infinity.finetune import data as fdata  # noqa: E402
from infinity.testing.tiny_hf import make_model_dir, write_corpus  # noqa: E402

from .test_train_hf import INFINITY, config  # noqa: E402 - the same command and config as there


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("ftd")
    return {"llama": make_model_dir(str(root / "llama"), "llama"), "gpt2": make_model_dir(str(root / "gpt2"), "gpt2"),
            "text": write_corpus(str(root / "text.jsonl"), rows=120), "root": root}


def run(*args, timeout=400):
    return subprocess.run(INFINITY + list(args), capture_output=True, text=True, timeout=timeout,
                          cwd=os.path.dirname(os.path.abspath(__file__)))


def rows_of(w: fdata.Windows) -> list:
    return [(r["input_ids"].tolist(), r["labels"].tolist()) for r in w.dataset]


@pytest.mark.slow
def test_windows_are_prepared_once_in_a_child_and_then_reused(files, tmp_path, monkeypatch):
    tok = transformers.AutoTokenizer.from_pretrained(files["llama"])
    data = tmp_path / "text.jsonl"
    data.write_bytes(open(files["text"], "rb").read())
    children = []
    real = subprocess.run

    def spy(cmd, *a, **k):
        children.append(cmd)
        return real(cmd, *a, **k)
    monkeypatch.setattr(subprocess, "run", spy)
    first = fdata.windows(str(data), tok, 64, cache_dir=str(tmp_path / "cache"))
    assert len(children) == 1 and "_child" in children[0][2]
    again = fdata.windows(str(data), tok, 64, cache_dir=str(tmp_path / "cache"))
    assert len(children) == 1, "the second call reads the entry the first one wrote"
    here = fdata.windows(str(data), tok, 64, cache_dir=str(tmp_path / "other"), isolate=False)
    assert len(children) == 1
    assert rows_of(first) == rows_of(again) == rows_of(here)
    assert first.tokens == here.tokens == len(first) * 64 and first.shape == "text" and first.packed
    entries = os.listdir(tmp_path / "cache" / "infinity-windows")
    assert len(entries) == 1 and not any(e.startswith(".") for e in entries), "no temp dir is left behind"
    # Another --seq, or the file changed: a new entry, never the old windows.
    fdata.windows(str(data), tok, 32, cache_dir=str(tmp_path / "cache"))
    with open(data, "a") as f:
        f.write(json.dumps({"text": "one more row " * 40}) + "\n")
    grown = fdata.windows(str(data), tok, 64, cache_dir=str(tmp_path / "cache"))
    assert len(children) == 3
    assert len(grown) > len(first)
    assert len(os.listdir(tmp_path / "cache" / "infinity-windows")) == 3


@pytest.mark.slow
def test_every_input_format_gives_the_windows_of_the_same_rows(files, tmp_path):
    tok = transformers.AutoTokenizer.from_pretrained(files["gpt2"])
    texts = [json.loads(line)["text"] for line in open(files["text"])]
    ds = datasets.Dataset.from_dict({"text": texts})
    ds.to_parquet(str(tmp_path / "rows.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "saved_dict"))
    cache = str(tmp_path / "cache")
    want = rows_of(fdata.windows(files["text"], tok, 64, cache_dir=cache, isolate=False))
    for path in ("rows.parquet", "saved", "saved_dict"):
        got = fdata.windows(str(tmp_path / path), tok, 64, cache_dir=cache, isolate=False)
        assert rows_of(got) == want, path
    # A datasets directory in a child process: nothing is written into it, and the second run reuses the entry.
    before = sorted(os.listdir(tmp_path / "saved"))
    first = fdata.windows(str(tmp_path / "saved"), tok, 48, cache_dir=cache)
    assert sorted(os.listdir(tmp_path / "saved")) == before
    entries = set(os.listdir(os.path.join(cache, "infinity-windows")))
    again = fdata.windows(str(tmp_path / "saved"), tok, 48, cache_dir=cache)
    assert set(os.listdir(os.path.join(cache, "infinity-windows"))) == entries and rows_of(again) == rows_of(first)
    assert not any(f.startswith("tokens") for e in entries for f in os.listdir(os.path.join(cache, "infinity-windows",
                                                                                            e)))
    # .txt: one document cut into lines, newlines kept, no special tokens: the windows are that token stream.
    lines = [t.replace("\n", " ") for t in texts[:40]]
    (tmp_path / "doc.txt").write_text("".join(t + "\n" for t in lines))
    txt = fdata.windows(str(tmp_path / "doc.txt"), tok, 64, cache_dir=cache)
    stream = [i for t in lines for i in tok(t + "\n", add_special_tokens=False)["input_ids"]]
    assert txt.shape == "text" and len(txt) >= 2
    assert txt.dataset[0]["input_ids"].tolist() == stream[:64]
    assert txt.dataset[1]["input_ids"].tolist() == stream[64:128]


@pytest.mark.slow
def test_a_data_error_found_in_the_child_reaches_the_caller_as_it_was_raised(files, tmp_path):
    tok = transformers.AutoTokenizer.from_pretrained(files["llama"])
    bad = tmp_path / "chat.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n")
    with pytest.raises(fdata.DataError, match="row 0 has no assistant turn, so nothing in it would be trained"):
        fdata.windows(str(bad), tok, 64, cache_dir=str(tmp_path / "cache"))
    assert os.listdir(tmp_path / "cache" / "infinity-windows") == [], "a failed preparation leaves no entry"


@pytest.mark.slow
def test_epochs_read_every_window_once_per_epoch(files, tmp_path, disk_dir):
    tok = transformers.AutoTokenizer.from_pretrained(files["gpt2"])
    w = fdata.windows(files["text"], tok, 64)
    per_epoch = len(w) // 4
    out = run("train", "--model", files["gpt2"], "--data", files["text"], "--config", config(tmp_path), "--seq", "64",
              "--epochs", "2", "--nvme-path", str(disk_dir), "--out", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * per_epoch, (len(rows), per_epoch)
    assert f"{2 * per_epoch} steps" in out.stdout
    sched = fdata.Schedule(windows=len(w), micro=4, world=1, accum=1, seed=0)
    epochs = [sorted(i for s in range(e * per_epoch, (e + 1) * per_epoch) for i in sched.indices(s, 0, 0))
              for e in (0, 1)]
    for e in epochs:  # no window twice in an epoch (the remainder of len(w) / 4 is left out, as drop_last does)
        assert len(set(e)) == len(e) == 4 * per_epoch and set(e) <= set(range(len(w)))
    assert [sched.indices(s, 0, 0) for s in range(per_epoch)] != \
        [sched.indices(s, 0, 0) for s in range(per_epoch, 2 * per_epoch)], "each epoch is shuffled anew"


@pytest.mark.slow
def test_merged_lora_from_the_run_and_from_its_checkpoint_equal_peffs_merge(files, tmp_path, disk_dir):
    peft = pytest.importorskip("peft", reason="peft is not installed (make deps installs it)")
    ck = tmp_path / "ck"
    out = run("train", "--model", files["gpt2"], "--data", files["text"], "--config", config(tmp_path), "--seq", "64",
              "--steps", "4", "--lora", "r=16,alpha=32,targets=c_attn,c_fc", "--merge-lora", "--save-dir", str(ck),
              "--nvme-path", str(disk_dir), "--out", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr[-3000:]
    final = tmp_path / "run" / "final"
    assert "model.safetensors" in os.listdir(final) and "adapter_config.json" not in os.listdir(final)
    from_run = transformers.AutoModelForCausalLM.from_pretrained(final).state_dict()

    adapter = run("checkpoint", "export", str(ck), "--hf", str(tmp_path / "adapter"))
    assert adapter.returncode == 0, adapter.stderr[-2000:]
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= set(
        os.listdir(tmp_path / "adapter"))
    base = transformers.AutoModelForCausalLM.from_pretrained(files["gpt2"])
    by_peft = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload().state_dict()

    merged = run("checkpoint", "export", str(ck), "--hf", str(tmp_path / "merged"), "--merge-lora")
    assert merged.returncode == 0, merged.stderr[-2000:]
    from_ckpt = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    assert set(from_run) == set(by_peft) == set(from_ckpt)
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(files["gpt2"]).state_dict()  # peft merged into base
    moved = 0
    for k in by_peft:
        assert torch.equal(from_ckpt[k], by_peft[k]), k
        assert torch.allclose(from_run[k], by_peft[k], rtol=0, atol=1e-6), k
        moved += not torch.equal(by_peft[k], pretrained[k])
    assert moved >= 4, "the merged weights differ from the base: the adapter was trained and merged"

    refused = run("checkpoint", "export", str(ck), "out.safetensors", "--merge-lora")
    assert refused.returncode != 0 and "--merge-lora goes with --hf OUT_DIR" in refused.stderr


@pytest.mark.slow
def test_merge_lora_export_of_a_checkpoint_without_peft_says_so(files, tmp_path, disk_dir):
    ck = tmp_path / "ck"
    out = run("train", "--model", files["gpt2"], "--data", files["text"], "--config", config(tmp_path), "--seq", "64",
              "--steps", "1", "--save-dir", str(ck), "--nvme-path", str(disk_dir), "--out", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr[-3000:]
    refused = run("checkpoint", "export", str(ck), "--hf", str(tmp_path / "x"), "--merge-lora")
    assert refused.returncode != 0
    assert "is not of a peft model, so there is no adapter to merge; drop --merge-lora" in refused.stderr
    assert "Traceback" not in refused.stderr


@pytest.mark.slow
def test_sigterm_to_the_launcher_alone_stops_every_rank_and_removes_swap_files(files, tmp_path, disk_dir):
    nvme = disk_dir / "swap"
    proc = subprocess.Popen(INFINITY + ["train", "--model", files["llama"], "--data", files["text"], "--config",
                                        config(tmp_path), "--steps", "100000", "--seq", "64", "--nvme-path",
                                        str(nvme), "--out", str(tmp_path / "run"), "--nproc", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.exists() and metrics.read_text()):
        time.sleep(0.2)
    assert any(nvme.rglob("*.swp")), "swap files exist while it trains"
    proc.send_signal(signal.SIGTERM)  # the launcher only, as `kill PID` or a scheduler does
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr[-2000:]
    assert "Traceback" not in stderr
    lines = [ln for ln in stderr.splitlines() if ln.startswith("infinity train: terminated (SIGTERM) at step")]
    assert len(lines) == 2, stderr[-2000:]
    assert not any(nvme.rglob("*.swp"))
