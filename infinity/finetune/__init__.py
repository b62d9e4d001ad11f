"""Fine-tuning a model you have on text you have: data (data.py), model and LoRA (model.py), what the run shows (progress.py)."""
