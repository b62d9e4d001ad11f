"""deepspeed.runtime: the pieces of DeepSpeed's runtime that scripts import by path."""
