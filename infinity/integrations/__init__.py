"""Integrations with other libraries' training loops: `infinity.integrations.transformers.InfinityTrainer`."""
