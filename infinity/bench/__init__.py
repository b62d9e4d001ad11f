"""`infinity bench ...`: standalone benchmarks of each layer (io, adam, swap, train, plan, checkpoint, peft) beside
their baselines (fio, torch, RAM); bench/RESULTS.md gives each figure with the command that reproduces it."""
