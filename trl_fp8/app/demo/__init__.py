"""The offline demo: the embedded model and the GRPO run on it."""
