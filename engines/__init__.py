"""Rollout engines behind rollout.Engine: hf (CPU reference, FP8 emulated) and vllm (GPU)."""
