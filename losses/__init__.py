"""GRPO policy-gradient losses, group advantages and train/rollout mismatch metrics."""
