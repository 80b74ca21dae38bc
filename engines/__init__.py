"""Rollout engines behind rollout.Engine: hf (CPU reference, FP8 emulated) and vllm (GPU); rollout.py
describes them. rollout.mode=async's trainer ranks use engines.remote.RemoteEngine instead, whose engine
ranks build theirs here."""

from __future__ import annotations

from config import Config
from rollout import Engine


def make_engine(cfg: Config, model, tokenizer, device, model_dir=None) -> Engine:
    """The engine cfg.rollout.engine names; model_dir: the config dir vLLM loads (None: the model's)."""
    if cfg.rollout.engine == "hf":
        from engines.hf import HFEngine

        return HFEngine(cfg, model, tokenizer, device)
    from engines.vllm import VLLMEngine

    return VLLMEngine(cfg, model, tokenizer, device, model_dir)
