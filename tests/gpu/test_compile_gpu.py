"""The trainer's compiled decoder layers compile no graph for a new micro-batch length once the first
step's variants exist, on a CUDA GPU; skipped without CUDA.

A variant first met after step 0 costs seconds of compiling, and under FSDP2 every other rank waits for
it at its next all-gather (docs/results.md, "The 2-rank train phase: a rank that compiles a new length
variant stalls the other"). Inductor guarded a dynamic-length graph on length % 8 (the trainer now pads
to distributed.COMPILED_ALIGN) and on the size thresholds of its mix-order reduction (off through
distributed.INDUCTOR_OPTIONS): at 4 rows of width 1024, lengths below 512, from 512, from 1,024 and from
1,280 each compiled the layer again.

    python -m pytest tests/gpu/test_compile_gpu.py -q
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_compiled_layers_meet_new_lengths_without_compiling():
    from torch._dynamo.utils import counters
    from transformers import LlamaConfig, LlamaForCausalLM

    from batch import amp, token_logprobs
    from distributed import COMPILED_ALIGN, compile_layers

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=1024, intermediate_size=2816, num_attention_heads=8,
                                         num_key_value_heads=8, head_dim=128, num_hidden_layers=2, vocab_size=512,
                                         max_position_embeddings=2048, attn_implementation="sdpa")).cuda()
    model.gradient_checkpointing_enable()  # fp32 master weights under bf16 autocast, as the 8B configs train
    torch._dynamo.reset()
    compile_layers(model, "inductor")
    model.train()
    g = torch.Generator("cuda").manual_seed(0)

    def step(length: int) -> None:  # a micro-batch's logprobs pass, then its train pass, at 4 rows
        ids = torch.randint(0, 512, (4, length), device="cuda", generator=g)
        with torch.no_grad(), amp(True):
            token_logprobs(model, ids, torch.ones_like(ids), 1.0)
        with amp(True):
            logp = token_logprobs(model, ids, torch.ones_like(ids), 1.0)
        logp.sum().backward()

    try:
        for length in (200, 208):  # step 0: a static variant, then the dynamic one
            step(length)
        first = counters["stats"]["unique_graphs"]
        later = (600, 1104, 1400, 256)  # one length in each of the other ranges, and back
        assert all(n % COMPILED_ALIGN == 0 for n in later)  # as trainer.assemble_batch pads them
        for length in later:
            step(length)
        grown = counters["stats"]["unique_graphs"] - first
    finally:
        torch._dynamo.reset()
    assert first > 0 and grown == 0, f"{grown} graphs compiled for lengths after the first step's ({first})"
