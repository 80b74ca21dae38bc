"""A tied model's head after a refit (skipped without CUDA or vLLM): SmolLM2 and other tied models stream
no `lm_head.weight` (fp8.export skips it), and vLLM's layerwise reload logs "ParallelLMHead: Failed to load
weights" for the head at every refit. This checks, for the BF16 and the FP8 rollout, that after each of two
refits with different weights the engine's lm_head equals the trainer's embedding bit for bit (and is the
engine's embedding storage), and that the warning is filtered for the tied head while other layers' still
pass. Runs as a subprocess per mode (`python tests/gpu/test_tied_head_gpu.py <mode>`): one engine per process.
"""

import logging
import sys

import pytest
import torch

from tiny_vllm import NEEDS_VLLM_GPU, TINY, run_mode

pytestmark = NEEDS_VLLM_GPU
MODES = {"bf16": [], "fp8": ["fp8.rollout=true"]}


@pytest.mark.parametrize("mode", list(MODES))
def test_tied_head_is_the_embedding_after_refit(mode):
    run_mode(__file__, mode, "tied-head")


def run(mode):
    from config import load_config
    from engines import vllm_internals
    from engines.vllm import VLLMEngine
    from fp8.export import export_weights
    from modeling import build_char_tokenizer, build_tiny_model

    cfg = load_config(None, TINY + ["rollout.sleep_mode=true"] + MODES[mode])
    tok = build_char_tokenizer(cfg.model.tiny.vocab)
    torch.manual_seed(0)
    model = build_tiny_model(cfg.model.tiny, tok, torch.bfloat16).cuda()
    model.config.tie_word_embeddings = True  # as SmolLM2's config.json says; vLLM ties at build
    model.lm_head.weight = model.model.embed_tokens.weight
    engine = VLLMEngine(cfg, model, tok, torch.device("cuda"))
    # the handler goes on after the engine is up: importing vllm runs logging's dictConfig for the "vllm"
    # logger, which empties the handlers of every existing child logger (logging.config._handle_existing_loggers)
    seen = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger(vllm_internals.RELOAD_LOGGER).addHandler(handler)
    assert engine.tied_head, "vLLM's head does not share its embedding's storage in a tied model"
    for refit in range(2):
        with torch.no_grad():
            model.model.embed_tokens.weight.add_(0.01 * torch.randn_like(model.model.embed_tokens.weight))
        names = [n for n, _ in export_weights(model, cfg.fp8, fp8=cfg.fp8.rollout)]
        assert "lm_head.weight" not in names
        engine.update_weights(export_weights(model, cfg.fp8, fp8=cfg.fp8.rollout))
        head, _ = engine.internal_weight("lm_head.weight")
        embed, _ = engine.internal_weight("model.embed_tokens.weight")
        want = model.model.embed_tokens.weight.detach()
        assert head.dtype == want.dtype and torch.equal(head, want), f"refit {refit}: lm_head != trainer embedding"
        assert torch.equal(embed, want), f"refit {refit}: embed_tokens != trainer embedding"
        assert vllm_internals.head_is_embedding(engine._model()), f"refit {refit}: head no longer shares storage"
        engine.sleep()
        print(f"[tied-head] {mode} refit {refit}: lm_head == trainer embedding, bit for bit "
              f"({tuple(head.shape)}, {head.dtype})", flush=True)
    heads = [m for m in seen if "ParallelLMHead" in m]
    assert not heads, f"tied head warning not filtered: {heads}"
    logging.getLogger(vllm_internals.RELOAD_LOGGER).warning("%s: Failed to load weights", "QKVParallelLinear")
    assert seen[-1] == "QKVParallelLinear: Failed to load weights"  # others still pass
    print(f"[tied-head] {mode}: no ParallelLMHead warning in {len(seen) - 1} other reload warnings", flush=True)


if __name__ == "__main__":
    run(sys.argv[1])
