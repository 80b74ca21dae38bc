"""HFEngine: group layout, EOS handling, and the logprob convention the trainer relies on."""


import pytest
import torch

from config import load_config
from modeling import load_model_and_tokenizer
from engines.hf import HFEngine
from rollout import Sample
from batch import by_length, collate, logprob_pass, token_logprobs

# 95 printable characters: a vocab larger than transformers' default top_k=50, so a sampler
# that silently applied top-k would renormalise and fail the convention test.
VOCAB = "".join(chr(c) for c in range(32, 127))


def make(overrides=()):
    cfg = load_config(None, ["model.dtype=float32", f"model.tiny.vocab={VOCAB!r}", "train.device=cpu", *overrides])
    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(cfg.model, torch.device("cpu"))
    return cfg, model, tok, HFEngine(cfg, model, tok, "cpu")


def test_logprobs_are_processed_logprobs_of_the_trainer():
    """Engine logprob of each sampled token == trainer log_softmax(logits / T) at that token."""
    cfg, model, tok, engine = make()
    prompts = [tok("3+4=").input_ids, tok("12+17=").input_ids]  # different lengths: left padding
    for temperature in (1.0, 0.6):
        samples = engine.generate(prompts, n=3, temperature=temperature, top_p=1.0, max_new_tokens=6, seed=0)
        assert [s.prompt_index for s in samples] == [0, 0, 0, 1, 1, 1]  # group by group
        input_ids, attention_mask, mask, rollout_logp = collate(samples, tok.pad_token_id)
        with torch.no_grad():
            trainer_logp = token_logprobs(model, input_ids, attention_mask, temperature)
        assert mask.sum() > 0
        torch.testing.assert_close(trainer_logp * mask, rollout_logp, atol=1e-5, rtol=0)


def test_token_logprobs_of_a_right_padded_batch_need_no_mask():
    """Right padding + causal attention: each row's logprobs equal its own unpadded forward's, and
    the model is called without the mask (HF would otherwise build an [B, 1, L, L] one and SDPA
    would leave its causal kernel)."""
    cfg, model, tok, engine = make()
    samples = [Sample(0, [5, 6], [7, 9, 11], [-1.0] * 3, "stop"), Sample(0, [5, 6, 9], [7] * 9, [-1.0] * 9, "length")]
    input_ids, attention_mask, mask, _ = collate(samples, tok.pad_token_id, multiple=16)
    seen = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("attention_mask")), with_kwargs=True)
    with torch.no_grad():
        logp = token_logprobs(model, input_ids, attention_mask, 0.7)
        hook.remove()
        for i, s in enumerate(samples):
            n = len(s.prompt_ids) + len(s.token_ids)
            alone = token_logprobs(model, input_ids[i: i + 1, :n], attention_mask[i: i + 1, :n], 0.7)
            torch.testing.assert_close(logp[i: i + 1, :n], alone, atol=1e-5, rtol=0)
    assert seen == [None] and logp.isfinite().all()


def test_token_logprobs_skip_transformers_packed_sequence_check(monkeypatch):
    """Without a mask, transformers checks at every forward whether position_ids pack sequences into a
    row, a host sync on a GPU; token_logprobs' rows never do, so the check must not run, and it is back
    in place after the forward."""
    from transformers import masking_utils

    def check(position_ids):
        raise AssertionError("transformers' packed-sequence check ran")

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", check)
    cfg, model, tok, engine = make()
    input_ids, attention_mask, _, _ = collate([Sample(0, [5, 6], [7, 9, 11], [-1.0] * 3, "stop")], tok.pad_token_id)
    with torch.no_grad():
        assert token_logprobs(model, input_ids, attention_mask, 0.7).isfinite().all()
        with pytest.raises(AssertionError, match="packed-sequence check ran"):
            model(input_ids=input_ids, use_cache=False)  # a plain forward still runs it: only ours skip it
    assert masking_utils.find_packed_sequence_indices is check


def test_fused_head_matches_logits_and_log_softmax(monkeypatch):
    """batch.token_logprobs' LM head + log-softmax in chunks (_HeadLogprobs, here 7 tokens a chunk) gives
    the unfused path's logprobs, entropies and every parameter's gradient through both (an entropy bonus
    in the loss), at T != 1; the head's output is [B, L, 2], never [B, L, V]."""
    import batch

    cfg, model, tok, engine = make()
    samples = [Sample(0, [5, 6], [7, 9, 11, 3], [-1.0] * 4, "stop"), Sample(0, [5, 6, 9], [7] * 9, [-1.0] * 9, "length")]
    input_ids, attention_mask, mask, _ = collate(samples, tok.pad_token_id)
    monkeypatch.setattr(batch, "LOGIT_CHUNK_BYTES", 7 * 4 * model.config.vocab_size)
    results = {}
    for fused in (True, False):
        model.zero_grad()
        shapes = []
        hook = model.get_output_embeddings().register_forward_hook(lambda m, a, out: shapes.append(out.shape))
        logp, ent = token_logprobs(model, input_ids, attention_mask, 0.7, entropy=True, fused=fused)
        ((logp * mask).sum() + 0.3 * (ent * mask).sum()).backward()
        hook.remove()
        results[fused] = logp, ent, {n: q.grad.clone() for n, q in model.named_parameters()}, shapes
    (lf, ef, gf, sf), (lu, eu, gu, su) = results[True], results[False]
    assert sf == [(2, input_ids.shape[1], 2)] and su[0][-1] == model.config.vocab_size
    torch.testing.assert_close(lf, lu, atol=2e-6, rtol=0)
    torch.testing.assert_close(ef, eu, atol=2e-6, rtol=0)
    assert not lf[:, 0].any() and ef[:, 1:].gt(0).all()
    for name in gu:
        torch.testing.assert_close(gf[name], gu[name], atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize("fused", [True, False])
def test_entropy_as_a_metric_is_detached_and_leaves_the_gradient_alone(fused, monkeypatch):
    """entropy_grad=False (train.old_logp=rollout's policy/entropy beside a loss without the bonus): the
    same entropies as with grad, detached (here 3 positions a chunk), and the logprobs' gradients those of
    a pass without entropy."""
    import batch

    cfg, model, tok, engine = make()
    monkeypatch.setattr(batch, "LOGIT_CHUNK_BYTES", 3 * 4 * model.config.vocab_size)
    samples = [Sample(0, [5, 6], [7, 9, 11, 3], [-1.0] * 4, "stop"), Sample(0, [5, 6, 9], [7] * 9, [-1.0] * 9, "length")]
    input_ids, attention_mask, mask, _ = collate(samples, tok.pad_token_id)
    grads, ents = [], []
    for kwargs in ({"entropy": False}, {"entropy": True, "entropy_grad": False}, {"entropy": True}):
        model.zero_grad()
        out = token_logprobs(model, input_ids, attention_mask, 0.7, fused=fused, **kwargs)
        logp, ent = out if kwargs["entropy"] else (out, None)
        (logp * mask).sum().backward()
        grads.append({n: q.grad.clone() for n, q in model.named_parameters()})
        ents.append(ent)
    assert not ents[1].requires_grad and ents[2].requires_grad
    torch.testing.assert_close(ents[1], ents[2].detach(), atol=1e-6, rtol=0)
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=0, rtol=0, msg=name)


def test_logprob_pass_groups_rows_by_length_and_cuts_the_padding():
    """by_length: micro-batches of rows of like length, longest first, each as long as its longest row
    rounded to the multiple; logprob_pass over them gives every row its own full-batch logprobs."""
    cfg, model, tok, engine = make()
    lengths = [3, 40, 7, 38, 12, 5]
    samples = [Sample(0, [5, 6], [7 + i % 50 for i in range(n)], [-1.0] * n, "stop") for n in lengths]
    input_ids, attention_mask, mask, _ = collate(samples, tok.pad_token_id, multiple=8)
    assert input_ids.shape == (6, 48)
    groups = by_length(attention_mask, torch.arange(6), 2, multiple=8)
    assert [(rows.tolist(), n) for rows, n in groups] == [([1, 3], 48), ([4, 2], 16), ([5, 0], 8)]
    assert [n for _, n in by_length(attention_mask, torch.tensor([0, 2, 5]), 2)] == [9, 5]  # within given rows
    with torch.no_grad():
        full = token_logprobs(model, input_ids, attention_mask, 0.7)
    cut, entropy = logprob_pass(model, input_ids, attention_mask, 0.7, micro_batch=2, entropy=True, plan=groups)
    torch.testing.assert_close(cut * mask, full * mask, atol=1e-5, rtol=0)
    assert entropy.shape == (6, 48) and not entropy[0, 8:].any() and entropy[1].gt(0).sum() >= 40


def test_by_length_packs_rows_into_a_token_budget():
    """budget > 0 (train.pack_micro_batches): rows of like length, longest first, packed while rows x
    length fits the budget, each micro-batch's rows x length a multiple of the token multiple; a
    row longer than the budget goes alone; count splits the micro-batches of most rows."""
    lengths = [100, 30, 250, 60, 20, 40, 10]  # row 2 is longer than the budget
    attention_mask = (torch.arange(256)[None, :] < torch.tensor(lengths)[:, None]).long()
    plan = by_length(attention_mask, torch.arange(7), 2, multiple=16, budget=200)
    assert [(rows.tolist(), n) for rows, n in plan] == [([2], 256), ([0], 112), ([3, 5, 1], 64), ([4, 6], 24)]
    assert all(len(rows) * n % 16 == 0 and (len(rows) * n <= 200 or len(rows) == 1) for rows, n in plan)
    assert sorted(i for rows, _ in plan for i in rows.tolist()) == list(range(7))  # every row once
    split = by_length(attention_mask, torch.arange(7), 2, multiple=16, budget=200, count=6)
    assert [(rows.tolist(), n) for rows, n in split] == [([2], 256), ([0], 112), ([3], 64), ([5], 48), ([1], 32),
                                                         ([4, 6], 24)]  # the longer of equal ones first
    with pytest.raises(ValueError, match="8 micro-batches asked of 7 rows"):
        by_length(attention_mask, torch.arange(7), 2, multiple=16, budget=200, count=8)
    rows = [(r.tolist(), n) for r, n in by_length(attention_mask, torch.arange(7), 3, multiple=16)]  # no budget
    assert rows == [([2, 0, 3], 256), ([5, 1, 4], 48), ([6], 16)]  # size rows, `multiple` a length multiple
    # align (compiled layers): every length also a multiple of 8, packed or not, so Inductor never
    # meets an unaligned length (a second graph per variant)
    loose = by_length(attention_mask, torch.arange(7), 2, multiple=4, budget=200)
    assert any(n % 8 for _, n in loose)
    for budget in (200, 0):
        aligned = by_length(attention_mask, torch.arange(7), 2, multiple=4, budget=budget, align=8)
        assert all(n % 8 == 0 and len(rows) * n % 4 == 0 for rows, n in aligned), aligned


def test_micro_plan_runs_as_many_micro_batches_as_the_busiest_rank(monkeypatch):
    """trainer.micro_plan over FSDP2 ranks: a rank whose rows pack into fewer micro-batches than another
    rank's splits its own until the counts agree (the max over ranks); rows mode never asks."""
    from types import SimpleNamespace

    import distributed
    import trainer

    asked = []
    monkeypatch.setattr(distributed, "all_sum", lambda x, d, op=None: asked.append(int(x)) or torch.tensor(5))
    lengths = [30, 28, 10, 9, 8, 8]
    b = SimpleNamespace(samples=[None] * 6, multiple=1, align=1,
                        attention_mask=(torch.arange(32)[None, :] < torch.tensor(lengths)[:, None]).long())
    run = SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(micro_batch_size=2, pack_micro_batches=True),
                                              micro_batch_tokens=64), d=SimpleNamespace(world=2, device=torch.device("cpu")))
    plan = trainer.micro_plan(run, b)
    assert asked == [2] and [r.tolist() for r, _ in plan] == [[0], [1], [2], [3], [4, 5]]  # 2 packed -> 5
    run.cfg.train.pack_micro_batches = False
    assert [r.tolist() for r, _ in trainer.micro_plan(run, b)] == [[0, 1], [2, 3], [4, 5]] and asked == [2]


def test_lengths_are_aligned_for_inductor_compiled_layers(monkeypatch):
    """Inductor guards a dynamic-length graph on length % 8, so a length first met unaligned after step 0
    compiles again (over FSDP2 the other ranks wait): under Inductor every length is a multiple of 8, on
    top of the FP8 GEMMs' token multiple; no alignment without Inductor. compile_layers passes Inductor
    the option that drops its length-range guards (mix-order reduction), and nothing to other backends."""
    import distributed
    import trainer

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    cases = [  # (overrides, fp8 token multiple, device) -> (multiple, align)
        (["train.compile=auto"], 1, cuda, (8, 8)),  # BF16: rows of any length before
        (["train.compile=auto"], 128, cuda, (32, 8)),  # FP8 at 4 rows: 32 is aligned already
        (["train.compile=auto", "train.micro_batch_size=2"], 128, cuda, (64, 8)),
        (["train.compile=auto", "train.pack_micro_batches=true"], 128, cuda, (128, 8)),
        (["train.compile=auto"], 1, cpu, (1, 1)),  # auto is eager on CPU
        (["train.compile=aot_eager"], 1, cuda, (1, 1)),  # no code generation, no alignment guard
        (["train.compile=inductor"], 1, cpu, (8, 8)),
    ]
    for overrides, fp8_tokens, device, want in cases:
        cfg = load_config(None, ["train.micro_batch_size=4", *overrides])
        assert trainer.length_multiples(cfg, fp8_tokens, 512, device) == want, (overrides, fp8_tokens, device)
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or fn)
    _, model, _, _ = make()
    for backend in ("inductor", "aot_eager"):
        distributed.compile_layers(model, backend)
    layers = len(model.model.layers)
    assert seen == [{"backend": "inductor", "options": {"triton.mix_order_reduction": False}}] * layers + \
        [{"backend": "aot_eager"}] * layers


def test_collate_rounds_length_for_fp8_tokens():
    """L rounds up to `multiple` (64: a micro-batch of 2 rows then holds a multiple of 128 tokens);
    the extra positions are padding, outside attention_mask and mask."""
    samples = [Sample(0, [5, 6], [7] * 60 + [8], [-0.5] * 61, "stop"), Sample(0, [5, 6, 9], [7] * 65, [-1.0] * 65, "length")]
    plain = collate(samples, 0)
    padded = collate(samples, 0, multiple=64)
    assert plain[0].shape == (2, 68) and padded[0].shape == (2, 128)
    for a, b in zip(plain, padded):
        assert torch.equal(b[:, :68], a) and not b[:, 68:].any()
    assert padded[2].sum() == 61 + 65 and padded[3][1, 3:68].eq(-1.0).all()


def test_collate_matches_a_row_by_row_fill():
    """The masked fill puts each sample's tokens and logprobs where a row-by-row copy would: prompts
    of any length, empty responses, float32 logprobs as torch.tensor rounds them."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(9):
        p, r = (int(x) for x in torch.randint(1, 12, (2,), generator=g))
        r = 0 if i == 4 else r
        samples.append(Sample(i // 3, torch.randint(1, 50, (p,), generator=g).tolist(),
                              torch.randint(1, 50, (r,), generator=g).tolist(),
                              (-torch.rand(r, generator=g, dtype=torch.float64)).tolist(), "stop"))
    ids, am, mask, logp = collate(samples, pad_id=0, multiple=8)
    assert ids.shape[1] % 8 == 0 and ids.dtype == am.dtype == torch.long and mask.dtype == logp.dtype == torch.float32
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.token_ids)
        assert ids[i, :p + r].tolist() == s.prompt_ids + s.token_ids and not ids[i, p + r:].any()
        assert am[i].tolist() == [1] * (p + r) + [0] * (ids.shape[1] - p - r)
        assert mask[i].nonzero().flatten().tolist() == list(range(p, p + r))
        assert torch.equal(logp[i, p:p + r], torch.tensor(s.logprobs)) and logp[i].count_nonzero() == r
    samples[2] = Sample(0, [5], [7, 8], [-1.0], "stop")
    with pytest.raises(ValueError, match="sample 2 has 1 logprobs for 2 response tokens"):
        collate(samples, pad_id=0)


def test_greedy_is_deterministic_and_eos_ends_samples():
    cfg, model, tok, engine = make()
    prompts = [tok("1+1=").input_ids]
    a = engine.generate(prompts, n=2, temperature=0.0, top_p=1.0, max_new_tokens=5)
    b = engine.generate(prompts, n=2, temperature=0.0, top_p=1.0, max_new_tokens=5)
    assert a[0].token_ids == a[1].token_ids == b[0].token_ids

    class EOSHead(torch.nn.Module):  # EOS is the only likely token: every sample stops after 1 token
        def forward(self, h):
            logits = torch.zeros(*h.shape[:-1], len(tok))
            logits[..., tok.eos_token_id] = 100.0
            return logits

    engine.model.lm_head = EOSHead()
    s = engine.generate(prompts, n=2, temperature=1.0, top_p=1.0, max_new_tokens=5, seed=0)
    assert all(x.token_ids == [tok.eos_token_id] and x.finish_reason == "stop" for x in s)


def test_samples_do_not_depend_on_batch_composition():
    """Per-sample seeds: prompts generated together or in separate calls (as when split over ranks)
    give the same samples when the second call starts at the right seed (seed + i*n)."""
    cfg, model, tok, engine = make()
    prompts = [tok("3+4=").input_ids, tok("12+17=").input_ids]
    both = engine.generate(prompts, n=3, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=7)
    first = engine.generate(prompts[:1], n=3, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=7)
    second = engine.generate(prompts[1:], n=3, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=7 + 3)
    assert [s.token_ids for s in both] == [s.token_ids for s in first + second]
    assert len({tuple(s.token_ids) for s in both}) > 2  # and they are samples, not one greedy answer
    for a, b in zip(both, first + second):
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("entropy_grad", [True, False])
def test_compiled_head_matches_the_row_by_row_log_softmax(entropy_grad):
    """compile_head (train.compile with the unfused head): the whole micro-batch's log-softmax in one compiled
    function gives the row-by-row path's logprobs, entropies and every parameter's gradient (an entropy
    bonus, or the entropy as a detached metric), at T != 1; micro-batches of other rows and lengths reuse
    its one graph."""
    from torch._dynamo.utils import counters

    cfg, model, tok, engine = make()
    samples = [Sample(0, [5, 6], [7, 9, 11, 3], [-1.0] * 4, "stop"), Sample(0, [5, 6, 9], [7] * 9, [-1.0] * 9, "length"),
               Sample(0, [5], [8] * 6, [-1.0] * 6, "stop")]
    input_ids, attention_mask, mask, _ = collate(samples, tok.pad_token_id)
    results = {}
    for backend in ("inductor", "none"):
        model.zero_grad()
        logp, ent = token_logprobs(model, input_ids, attention_mask, 0.7, entropy=True, fused=False,
                                   entropy_grad=entropy_grad, compile_head=backend)
        ((logp * mask).sum() + (0.3 * (ent * mask).sum() if entropy_grad else 0)).backward()
        results[backend] = logp, ent, {n: q.grad.clone() for n, q in model.named_parameters()}
    (lc, ec, gc), (le, ee, ge) = results["inductor"], results["none"]
    torch.testing.assert_close(lc, le, atol=2e-6, rtol=0)
    torch.testing.assert_close(ec, ee, atol=2e-6, rtol=0)
    assert ec.requires_grad == entropy_grad and not lc[:, 0].any()
    for name in ge:
        torch.testing.assert_close(gc[name], ge[name], atol=1e-6, rtol=1e-4, msg=name)
    graphs = counters["stats"]["unique_graphs"]
    for rows, n in ((slice(0, 2), 9), (slice(1, 3), 12)):
        token_logprobs(model, input_ids[rows, :n], attention_mask[rows, :n], 0.7, entropy=True, fused=False,
                       entropy_grad=entropy_grad, compile_head="inductor")[0].sum().backward()
    assert counters["stats"]["unique_graphs"] == graphs
