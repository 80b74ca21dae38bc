"""HFEngine: the CPU / debug reference engine, with vLLM's FP8 numerics emulated on an HF model.

The engine holds its own copy of the model and receives weights through the same export stream
vLLM gets (fp8/export.py). Three pieces emulate what vLLM's FP8 rollout computes:

* W8A8 block linears (`convert_to_fp8_rollout`): the fp8_plan linears become EmulatedFP8Linear
  with vLLM's activation recipe (1x128 tiles, divide by amax/448), on exactly the skip-list the
  trainer and the export use.
* The weight stream (`load_exported_into_hf`): FP8 weights are dequantized into the parameters,
  and the exact exported FP8 bytes are pinned in the W8A8 linears, so their GEMMs use them.
* FP8 KV cache + attention (`set_kv_scales`, `fp8_attention`): q, k, v fake-quantized to e4m3
  with one static scale per layer and tensor, through the attention hook of fp8/calibrate.py
  (the same hook the trainer's q/k/v calibration records in; it records before the fake quant).

Attention emulation vs vLLM (FA3 backend with kv_cache_dtype=fp8): k/v quantized exactly as the
cache write kernel does (divide by scale, saturate), q as QuantFP8's static per-tensor path
(multiply by fp32(1/scale)). Not emulated: the e4m3 rounding of the softmax probabilities P
inside FA3's FP8 kernel, and the dequantized q/k/v are rounded to the model dtype here whereas
FA3 applies the descales to its fp32 accumulators. So the CPU engine computes what vLLM would up
to accumulation order and those two roundings.
"""

import contextlib
import copy
from typing import Iterable

import torch
import torch.nn as nn
from torch import Tensor

import routing
from config import Config, FP8Config
from fp8.calibrate import install, start_kv_scales
from fp8.export import KV_SCALE_NAMES, SCALE_SUFFIX, kv_scale_names
from fp8.convert import convert_planned
from fp8.linear import EmulatedFP8Linear
from fp8.moe import BlockFP8Experts, expert_names
from fp8.plan import clean_name, fp8_plan, log_summary
from fp8.quant import BLOCK, E4M3, dequantize_blockwise, fake_quant_per_tensor
from models import attention_modules
from rollout import Sample


class HFEngine:
    """Batched sampling with HF transformers on a private copy of the model."""

    def __init__(self, cfg: Config, model: nn.Module, tokenizer, device):
        self.cfg, self.tokenizer, self.device = cfg, tokenizer, device
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        if cfg.fp8.rollout:  # W8A8 block linears on the same skip-list as the trainer and export
            convert_to_fp8_rollout(self.model, cfg.fp8)
        # fp8.kv_cache, as vLLM: FP8 attention with scales 1.0 until calibrated scales arrive
        start_kv_scales(self, cfg.fp8, range(self.model.config.num_hidden_layers))

    @torch.no_grad()
    def update_weights(self, weights):
        load_exported_into_hf(self.model, weights)

    def set_kv_scales(self, scales):
        set_kv_scales(self.model, scales)  # q/k/v fake-quantized to e4m3 with these scales

    def sleep(self):  # nothing to release on CPU
        pass

    def wake(self):
        pass

    @torch.no_grad()
    def generate(self, prompt_ids, n, temperature, top_p, max_new_tokens, seed=None):
        """Sampling is Gumbel-max with one generator per sample (sample j of prompt i: seed + i*n + j),
        so a sample does not depend on which other prompts share the batch (e.g. how prompts are
        split over ranks), as in vLLM's per-request seeds."""
        from transformers import GenerationConfig, LogitsProcessorList

        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        rows = [ids for ids in prompt_ids for _ in range(n)]  # group by group
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, r in enumerate(rows):  # left padding
            input_ids[i, width - len(r):] = torch.tensor(r)
            attention_mask[i, width - len(r):] = 1
        greedy = temperature == 0
        if seed is None:
            seed = int(torch.randint(2**62, ()))
        sampler = None if greedy else _GumbelSampler(range(seed, seed + len(rows)), temperature, top_p)
        gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos,
                                   pad_token_id=pad, output_scores=True, return_dict_in_generate=True)
        # routed: MoE, each router's top-k ids of every forward call
        with routing.capture(self.model) as routed, _cpu_threads(self.device, self.cfg.rollout.hf_cpu_threads):
            out = self.model.generate(input_ids=input_ids.to(self.device),
                                      attention_mask=attention_mask.to(self.device), generation_config=gen_cfg,
                                      logits_processor=LogitsProcessorList([sampler] if sampler else []))
        if routed is not None:  # [R, width + calls - 1, layers, k]: prefill, then one position per call
            routed = torch.stack([torch.cat([c.view(len(rows), -1, c.shape[-1]) for c in calls], 1)
                                  for calls in routed], dim=2).to(torch.int16).cpu()
        new_tokens = out.sequences[:, width:]  # [B, T_new]
        # processed logits: log_softmax(top-p(logits / T)) (greedy: the raw logits)
        scores = torch.stack(sampler.processed if sampler else out.scores, dim=1).float()  # [B, T_new, V]
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)  # [B, T_new]
        samples = []
        for i, r in enumerate(rows):
            toks = new_tokens[i].tolist()
            finish = "length"
            if eos in toks:
                toks, finish = toks[: toks.index(eos) + 1], "stop"
            samples.append(Sample(i // n, r, toks, logprobs[i, : len(toks)].tolist(), finish, None if routed is None
                                  else routed[i, width - len(r): width + len(toks) - 1].clone()))  # [P + T - 1, ...]
        return samples


class _GumbelSampler:
    """HF logits processor that turns greedy decoding into sampling: argmax(l + G) with G ~ Gumbel(0, 1)
    i.i.d. is an exact draw from softmax(l), for l = top-p(logits / T). Each row has its own generator;
    `processed` keeps l per step (the distribution the sample came from)."""

    def __init__(self, seeds, temperature: float, top_p: float):
        from transformers import TopPLogitsWarper

        self.gens = [torch.Generator().manual_seed(s) for s in seeds]
        self.temperature, self.processed = temperature, []
        self.top_p = TopPLogitsWarper(top_p) if top_p < 1.0 else None

    def __call__(self, input_ids, scores):
        logits = scores.float() / self.temperature
        if self.top_p is not None:
            logits = self.top_p(input_ids, logits)
        self.processed.append(logits)
        u = torch.empty(len(self.gens), logits.shape[-1], dtype=torch.float64)  # [B, V]
        for row, g in zip(u, self.gens):  # the same draws as torch.rand(V, generator=g, dtype=float64)
            row.uniform_(generator=g)
        gumbel = u.clamp_min_(1e-300).log_().neg_().log_().neg_()  # -log(-log u), in place: no [B, V] temporaries
        return logits + gumbel.to(logits)


@contextlib.contextmanager
def _cpu_threads(device, n: int):
    """torch's intra-op thread count set to n (> 0) on a CPU device while generating, restored after."""
    if n <= 0 or torch.device(device).type != "cpu" or n == torch.get_num_threads():
        yield
        return
    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


# ------------------------------------------------------------------------ W8A8 block linears

def convert_to_fp8_rollout(model: nn.Module, cfg: FP8Config) -> list[str]:
    """CPU/HF stand-in for vLLM's block W8A8 linears: EmulatedFP8Linear with vLLM's activation
    recipe on exactly the fp8_plan set; returns their HF names. Feed weights with load_exported_into_hf."""
    plan = fp8_plan(model, cfg)
    converted = convert_planned(model, cfg, plan, lambda mod: EmulatedFP8Linear.from_linear(mod, "vllm"),
                                "vllm")  # experts: vLLM's block-FP8 fused MoE
    log_summary("block-W8A8 (vLLM emulation)", plan)
    return converted


@torch.no_grad()
def load_exported_into_hf(model: nn.Module, pairs: Iterable[tuple[str, Tensor]]) -> set[str]:
    """Receive an export_weights stream into an HF model, as vLLM would.

    FP8 weights are dequantized (q * scale_inv, float32, then the parameter dtype); into an
    EmulatedFP8Linear (convert_to_fp8_rollout) the exact FP8 bytes are also pinned, so its GEMM
    uses them. MoE experts arrive as one linear per expert (fp8/export.py) and are written into their rows
    of the 3-D parameters (into a BlockFP8Experts, fp8/moe.py, with the exact FP8 bytes pinned too).
    KV scales, if present, turn on FP8 attention emulation (set_kv_scales).
    Returns the names of the parameters/buffers written; raises KeyError on a name the model lacks.
    """
    params = {clean_name(n): t for n, t in model.state_dict(keep_vars=True).items()}
    modules = {clean_name(n): m for n, m in model.named_modules()}
    experts = expert_names(model)  # per-expert linear -> its rows of a 3-D parameter
    pending: dict[str, dict[str, Tensor]] = {}  # prefix -> {"q": ..., "s": ...} until both arrived
    kv_prefix = {p: i for i, p in kv_scale_names(model).items()}
    kv: dict[int, dict[str, float]] = {}
    loaded: set[str] = set()
    for name, t in pairs:
        if name.endswith(SCALE_SUFFIX) or (t.dtype == E4M3 and name.endswith(".weight")):
            is_scale = name.endswith(SCALE_SUFFIX)
            prefix = name[: -len(SCALE_SUFFIX)] if is_scale else name[: -len(".weight")]
            slot = pending.setdefault(prefix, {})
            slot["s" if is_scale else "q"] = t
            if len(slot) < 2:
                continue
            del pending[prefix]
            if prefix in experts:
                module, param, e, rows = experts[prefix]
                mod = modules[module]
                if isinstance(mod, BlockFP8Experts):
                    mod.load_fp8_expert(param, e, rows, slot["q"], slot["s"])
                else:
                    target = params[f"{module}.{param}"]
                    target[e, rows] = dequantize_blockwise(slot["q"].to(target.device), slot["s"].to(target.device),
                                                           BLOCK, target.dtype)
                loaded.add(prefix + ".weight")
                continue
            target = params.get(prefix + ".weight")
            if target is None:
                raise KeyError(f"exported FP8 weight {prefix}.weight not in model")
            mod = modules.get(prefix)
            if isinstance(mod, EmulatedFP8Linear):
                mod.load_fp8_weight(slot["q"], slot["s"])
            else:
                target.copy_(dequantize_blockwise(slot["q"].to(target.device), slot["s"].to(target.device),
                                                  BLOCK, target.dtype))
            loaded.add(prefix + ".weight")
            continue
        prefix, _, leaf = name.rpartition(".")
        if leaf in KV_SCALE_NAMES and prefix in kv_prefix:
            kv.setdefault(kv_prefix[prefix], {})[leaf] = float(t)
            continue
        if (entry := experts.get(name.removesuffix(".weight"))) is not None:  # one expert's BF16 linear
            module, param, e, rows = entry
            params[f"{module}.{param}"][e, rows] = t.to(params[f"{module}.{param}"].dtype)
            loaded.add(name)
            continue
        target = params.get(name)
        if target is None:
            raise KeyError(f"exported tensor {name} not in model")
        target.copy_(t.to(target.device, target.dtype))
        loaded.add(name)
    if pending:
        raise ValueError(f"FP8 weights without their scale (or vice versa): {sorted(pending)}")
    if kv:
        set_kv_scales(model, {i: tuple(d[n] for n in KV_SCALE_NAMES) for i, d in kv.items()})
    return loaded


# ------------------------------------------------------------------ FP8 KV cache + attention

class _FakeQuantSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, scale: float, reciprocal: bool) -> Tensor:
        return fake_quant_per_tensor(x, scale, reciprocal)

    @staticmethod
    def backward(ctx, g: Tensor):
        return g, None, None


def _fake_quant(x: Tensor, scale: float, reciprocal: bool) -> Tensor:
    if torch.is_grad_enabled() and x.requires_grad:  # straight-through gradient, if ever trained
        return _FakeQuantSTE.apply(x, scale, reciprocal)
    return fake_quant_per_tensor(x, scale, reciprocal)


class FP8QKV:
    """One layer's q/k/v transform for the fp8/calibrate.py attention hook: each tensor
    fake-quantized to e4m3 with its scale (q multiplied by 1/scale, k/v divided, as vLLM)."""

    def __init__(self, scales: tuple[float, float, float]):
        self.scales = tuple(float(s) for s in scales)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        qs, ks, vs = self.scales
        return _fake_quant(q, qs, True), _fake_quant(k, ks, False), _fake_quant(v, vs, False)


def set_kv_scales(model: nn.Module, scales: dict[int, tuple[float, float, float]] | None) -> None:
    """Turn on FP8 q/k/v fake quantization with {layer: (q_scale, k_scale, v_scale)}; None = off."""
    mods = install(model)
    if scales is not None and (missing := sorted(set(mods) - set(scales))):
        raise KeyError(f"kv scales missing for layers {missing}")
    for i, m in mods.items():
        m._fp8_qkv.transform = None if scales is None else FP8QKV(scales[i])


def get_kv_scales(model: nn.Module) -> dict[int, tuple[float, float, float]] | None:
    """{layer: (q, k, v) scale} set by set_kv_scales, or None when FP8 attention is off."""
    st = {i: getattr(m, "_fp8_qkv", None) for i, m in attention_modules(model).items()}
    if not st or any(s is None or not isinstance(s.transform, FP8QKV) for s in st.values()):
        return None
    return {i: s.transform.scales for i, s in st.items()}


@contextlib.contextmanager
def fp8_attention(model: nn.Module, scales: dict[int, tuple[float, float, float]]):
    """Context manager form of set_kv_scales; restores the previous scales on exit."""
    prev = get_kv_scales(model)
    set_kv_scales(model, scales)
    try:
        yield model
    finally:
        set_kv_scales(model, prev)
