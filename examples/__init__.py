"""Runnable examples: `python -m shoal.examples.train_ddp` (or `shoal run ... -m ...`)."""
