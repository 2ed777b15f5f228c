"""Fast QLoRA: a 4-bit base that no longer pays a dequantization on every forward and every decoded token."""
