"""DUET: a per-step token budget for GRPO (rollouts per prompt, and when to stop a rollout)."""
