#!/usr/bin/env bash
# Fine-tune a Hugging Face model directory on a jsonl file with the main job, then load the result.
#   bash examples/finetune_cli.sh MODEL_DIR DATA.jsonl OUT [extra infinity train flags, e.g. --lora r=16]
set -euo pipefail
model=$1 data=$2 out=$3
shift 3
infinity train --model "$model" --data "$data" --eval-fraction 0.05 --out "$out" "$@"
python - "$out/final" <<'PY'
import sys, transformers
d = sys.argv[1]
tok = transformers.AutoTokenizer.from_pretrained(d)
try:
    model = transformers.AutoModelForCausalLM.from_pretrained(d)
except OSError:  # --lora without --merge-lora wrote the adapter; its config names the base model's directory
    import peft
    model = peft.AutoPeftModelForCausalLM.from_pretrained(d)
ids = tok("The", return_tensors="pt")["input_ids"]
print(tok.decode(model.generate(ids, max_new_tokens=12, do_sample=False)[0]))
PY
