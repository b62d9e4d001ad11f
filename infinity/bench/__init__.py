"""`infinity bench ...`: standalone benchmarks of each layer (io, adam, swap, train, plan, checkpoint, peft) beside
their baselines (fio, torch, RAM); bench/ at the top of the tree says how to reproduce the README's figures."""
