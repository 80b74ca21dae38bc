"""VLLMEngine: vLLM in-process, colocated with the trainer (the GPU engine of rollout.py).

Everything vLLM-specific is imported lazily: importing this module (CPU CI, the tests of this module)
never imports vLLM. The engine uses vLLM's public API (vllm.LLM, SamplingParams, sleep / wake_up, the
layerwise reload_weights); every internal it needs beyond that lives in engines/vllm_internals.py, which
checks them before the engine starts. Behaviours described below are those of vLLM 0.26.0 (requirements.txt).
"""

import contextlib
import logging
import os
import random
import re
import time
from typing import Iterable

import torch
import torch.nn as nn

from config import Config, UserError
import engines.vllm_internals as internals
from fp8.calibrate import start_kv_scales
from fp8.plan import LAYER_RE  # `layers.<i>.` in module names
from fp8.quant import BLOCK
from rollout import Sample

_KV_SCALE_RE = re.compile(r"\b(q|k|v|kv)_scale$")  # after the layer index: ...self_attn[.k_proj].k_scale


def vllm_env(cfg: Config) -> dict[str, str]:
    """Environment vLLM must see before it is imported / the engine is built."""
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process: weights reachable
        "VLLM_USE_DEEP_GEMM_E8M0": "0",  # else block scales are re-rounded to powers of two
    }
    if cfg.rollout.tensor_parallel_size > 1:  # torch symmetric-memory all-reduce (vLLM's default) needs NVLink
        # multicast: on a host without it the first TP forward dies with an illegal address (docs/log.md)
        env["VLLM_ALLREDUCE_USE_SYMM_MEM"] = os.environ.get("VLLM_ALLREDUCE_USE_SYMM_MEM", "0")
    if cfg.fp8.kv_cache and cfg.fp8.kv_attention == "xqa":  # vllm_internals.patch_xqa_scales: vLLM offers XQA only
        # if NVIDIA's artifact server answers, or with this flag (XQA itself is JIT-built from source)
        env["VLLM_HAS_FLASHINFER_CUBIN"] = "1"
    backend = cfg.fp8.linear_backend
    if backend in ("cutlass", "triton"):  # no DeepGEMM anywhere: no JIT, no deep_gemm warmup
        env["VLLM_USE_DEEP_GEMM"] = "0"
    elif backend == "deep_gemm":
        env["VLLM_USE_DEEP_GEMM"] = "1"
    return env


def vllm_engine_kwargs(cfg: Config, model_dir: str, world_size: int = 1, quant_config: dict | None = None,
                       architecture: str | None = None, moe: bool = False) -> dict:
    """Keyword arguments of vllm.LLM (== vllm.engine.arg_utils.EngineArgs fields) for this run.

    architecture: the trainer's class (e.g. LlamaForCausalLM), forced through hf_overrides so a
    config dir without "architectures" (modeling.save_config_dir writes it; older dirs may lack
    it) cannot make vLLM 0.26 resolve the headless LlamaModel. quant_config:
    fp8.export.vllm_quantization_config (fp8.rollout), whose ignored_layers are the HF linears THE
    skip-list keeps in BF16. moe: a mixture-of-experts model, whose engine returns each token's experts
    (vLLM 0.26 ModelConfig.enable_return_routed_experts -> CompletionOutput.routed_experts)."""
    r, f = cfg.rollout, cfg.fp8
    overrides = {"architectures": [architecture]} if architecture else {}
    kw = dict(
        model=str(model_dir), dtype="bfloat16", tensor_parallel_size=r.tensor_parallel_size, seed=r.seed,
        load_format="dummy",  # real weights arrive through update_weights (reload_weights)
        gpu_memory_utilization=r.gpu_memory_utilization, enable_sleep_mode=r.sleep_mode,
        enforce_eager=r.enforce_eager, max_model_len=r.max_model_len or cfg.data.max_prompt_tokens + r.max_new_tokens,
        logprobs_mode="processed_logprobs",  # log_softmax(logits / T): the repo's convention
    )
    if r.block_size:
        kw["block_size"] = r.block_size
    if r.max_num_seqs:
        kw["max_num_seqs"] = r.max_num_seqs
    if r.kv_cache_gib:  # a fixed KV cache: no free-memory profile that a neighbour's allocations can upset
        kw["kv_cache_memory_bytes"] = int(r.kv_cache_gib * 2**30)
    if moe:  # routing.py: router replay and moe/routing_mismatch read Sample.routed_experts
        kw["enable_return_routed_experts"] = True
    if f.rollout:
        kw["quantization"] = "fp8"
        if quant_config is None:
            raise ValueError("fp8.rollout needs quant_config=fp8.export.vllm_quantization_config(model, cfg.fp8)")
        overrides["quantization_config"] = quant_config
        if f.linear_backend != "auto":
            kw["linear_backend"] = f.linear_backend  # KernelConfig.linear_backend filters the kernel list
    if f.kv_cache:
        kw["kv_cache_dtype"] = "fp8"  # scales come from set_kv_scales (vLLM's calculate_kv_scales is off by default)
        # FA3 reads q/k/v descales from device tensors at launch, so set_kv_scales' in-place
        # updates reach it (also inside CUDA graphs); FlashInfer bakes host floats unless patched (xqa).
        kw["attention_config"] = {"fa3": {"backend": "FLASH_ATTN", "flash_attn_version": 3},
                                  "triton": {"backend": "TRITON_ATTN"},
                                  "xqa": {"backend": "FLASHINFER"}}[f.kv_attention]  # patch_xqa_scales
    if world_size > 1:  # torchrun: vLLM lays ranks out as external DP x TP (parallel_state.py); each group
        # of tensor_parallel_size consecutive ranks is one engine, the groups generate independently
        kw["distributed_executor_backend"] = "external_launcher"
        if r.tensor_parallel_size > 1:  # NCCL all-reduce only: no IPC buffers outside the sleep-mode allocator,
            # and no all-reduce + RMSNorm fusion (its FlashInfer backend also needs multicast memory)
            kw["disable_custom_all_reduce"] = True
            kw["compilation_config"] = {"pass_config": {"fuse_allreduce_rms": False}}
    elif r.tensor_parallel_size > 1:
        raise ValueError(f"rollout.tensor_parallel_size={r.tensor_parallel_size} needs as many torchrun ranks")
    if overrides:
        kw["hf_overrides"] = overrides
    return kw


def drawn_lengths(count: int, median: int, sigma: float, cap: int, seed: int) -> list[int]:
    """`count` generation lengths from a log-normal (median, sigma) in tokens, cut to [1, cap]:
    rollout.ignore_eos_median's benchmark workload (the same seed gives the same lengths anywhere)."""
    import numpy as np
    draw = np.random.default_rng(seed).lognormal(np.log(median), sigma, count)
    return [int(x) for x in np.clip(np.rint(draw), 1, cap)]


def vllm_requests(prompt_ids: list[list[int]], n: int, temperature: float, top_p: float,
                  max_new_tokens: int, seed: int | None = None, ignore_eos: bool = False,
                  lengths: list[int] | None = None):
    """[(prompt_index, TokensPrompt, SamplingParams)] for LLM.generate.

    Greedy (temperature 0) is one request per sample (vLLM refuses n > 1 when greedy); sampling
    is one request with n samples per prompt, seeded seed + i * n for prompt i (vLLM gives its
    j-th sample seed + i * n + j: all distinct). logprobs=0 returns only the sampled token's
    logprob; flat_logprobs keeps it in plain lists; no detokenization (the trainer decodes).
    ignore_eos: fixed-length generation, for benchmarks. lengths: (with ignore_eos) each sample's own
    max_tokens, prompt by prompt: one request per sample, the j-th of prompt i seeded seed + i * n + j
    as vLLM would seed it inside an n-sample request.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    greedy = temperature == 0
    per = 1 if greedy or lengths is not None else n
    out = []
    for i, ids in enumerate(prompt_ids):
        for j in range(n // per):
            k = i * n + j if per == 1 else i * n  # the first sample's index (and seed offset)
            params = SamplingParams(n=per, temperature=0.0 if greedy else temperature, top_p=1.0 if greedy else top_p,
                                    max_tokens=max_new_tokens if lengths is None else lengths[k], logprobs=0,
                                    flat_logprobs=True, detokenize=False, ignore_eos=ignore_eos,
                                    seed=None if greedy or seed is None else seed + k)
            out.append((i, TokensPrompt(prompt_token_ids=list(ids)), params))
    return out


@contextlib.contextmanager
def kept_env(name: str):
    """Restore os.environ[name] (or its absence) on exit. vLLM's engine start points the process-wide
    TRITON_CACHE_DIR into its per-config compile cache (vllm/compilation/compiler_interface.py), so
    torchao's autotuning in the colocated trainer would not land in fp8.torchao.keep_triton_autotuning's
    fixed dir (docs/log.md)."""
    before = os.environ.get(name)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


@contextlib.contextmanager
def own_rendezvous(world_size: int):
    """While a one-rank engine starts under torchrun (`--nproc_per_node 1`, or an engine rank of
    rollout.mode=async): TORCHELASTIC_USE_AGENT_STORE unset. vLLM 0.26 gives a one-rank engine its own
    process group on a fresh TCP port (tcp://<host ip>:<port>); with torchrun's
    TORCHELASTIC_USE_AGENT_STORE=True, torch dials that port as a client of a store nobody hosts, and
    the engine start hangs until the store's timeout. Several ranks join the trainer's group instead
    (external_launcher) and need no change."""
    with kept_env("TORCHELASTIC_USE_AGENT_STORE"):
        if world_size == 1:
            os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        yield


def kv_scale_entry(name: str) -> tuple[int, str] | None:
    """(layer, 'q'|'k'|'v'|'kv') for a checkpoint-style kv-scale name, e.g.
    model.layers.3.self_attn.k_scale or model.layers.3.self_attn.k_proj.k_scale ('kv': the
    deprecated shared k/v scale); None for anything else (weight_scale_inv included)."""
    layer = LAYER_RE.search(name)
    m = _KV_SCALE_RE.search(name, layer.end()) if layer else None
    return (int(layer.group(1)), m.group(1)) if m else None


def routed_experts(output) -> torch.Tensor | None:
    """A vLLM 0.26 CompletionOutput's routed_experts (numpy [P + T - 1, moe layers, k]: the prompt's routing
    at prefill, then the routing of each fed-back token) as int16, Sample.routed_experts; None when not
    returned (a dense model, or enable_return_routed_experts off)."""
    r = getattr(output, "routed_experts", None)
    return None if r is None else torch.as_tensor(r).to(torch.int16)


class VLLMEngine:
    """vLLM in-process, colocated with the trainer: one `vllm.LLM` per process (vLLM allows one).

    Weights: the engine starts from dummy weights; every `update_weights` streams the export
    (fp8 e4m3 weights + fp32 weight_scale_inv for FP8 linears, bf16 for the rest) through vLLM's
    layerwise `reload_weights`, which copies into the existing parameter storage (CUDA graphs
    stay valid). `generate` refuses to run before the first update.
    Sleep (rollout.sleep_mode): level 2 frees weights and KV cache; `update_weights` wakes only
    the weights before reloading, `generate`/`wake` wake the rest. Because level 2 discards the
    weights, a sleep must be followed by update_weights before the next generate.
    KV scales: written in place into each Attention layer's scale tensors (see set_kv_scales).
    """

    def __init__(self, cfg: Config, model: nn.Module, tokenizer, device, model_dir=None):
        self.cfg, self.tokenizer, self.device = cfg, tokenizer, device
        if model_dir is None:  # the tiny model has no dir of its own: write config + tokenizer
            if cfg.model.name_or_path != "tiny":
                model_dir = cfg.model.name_or_path
            else:
                import tempfile

                from modeling import save_config_dir

                model_dir = save_config_dir(model, tokenizer, tempfile.mkdtemp(prefix="vllm_engine_"))
        # rollout.mode=async: an engine rank's vLLM is a one-rank engine on this rank's GPU (engines/remote.py)
        alone = cfg.rollout.mode == "async"
        world_size = 1 if alone else int(os.environ.get("WORLD_SIZE", "1"))
        if world_size > 1 and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            # vLLM 0.26 external_launcher joins the trainer's process group (world_size 1 + RANK>0 fails)
            raise RuntimeError("VLLMEngine under torchrun: initialize torch.distributed before the engine")
        from fp8.export import vllm_quantization_config
        quant_config = vllm_quantization_config(model, cfg.fp8) if cfg.fp8.rollout else None
        arch = (getattr(getattr(model, "config", None), "architectures", None) or [type(model).__name__])[0]
        import routing

        self.engine_kwargs = vllm_engine_kwargs(cfg, model_dir, world_size, quant_config, arch, routing.is_moe(model))
        if alone and device.index is not None:  # vLLM's one-rank worker takes cuda:0 unless told
            self.engine_kwargs["device_ids"] = [device.index]
        os.environ.update(vllm_env(cfg))  # before the first `import vllm`
        try:
            import vllm
        except (ImportError, OSError) as e:  # not installed, or a build that does not match this CUDA/torch
            why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
            raise UserError(f"rollout.engine=vllm but vllm does not import ({why}); install it on a Linux CUDA "
                            "host with `pip install vllm==0.26.0` (requirements.txt), or set "
                            "rollout.engine=hf") from None

        internals.check_installed(cfg)  # every vLLM internal this config relies on, before minutes of start-up
        if cfg.fp8.kv_cache and cfg.fp8.kv_attention == "xqa":
            if why := internals.xqa_unavailable():
                raise UserError(f"fp8.kv_attention=xqa: {why}")
            internals.patch_xqa_scales()
        t0 = time.perf_counter()
        # the trainer's Triton autotuning stays in its fixed dir; a one-rank engine under torchrun starts
        with kept_env("TRITON_CACHE_DIR"), own_rendezvous(world_size):
            self.llm = vllm.LLM(**self.engine_kwargs)
        self.startup_s = time.perf_counter() - t0
        self.preemptions = 0  # sequences preempted for KV-cache room, over the engine's life (None: not counted)
        if not internals.count_preemptions(self.llm, self._preempted):
            self.preemptions = None
        # Model Runner V2's Gumbel sampler seeds every request from (seed, position) in one kernel; unseeded
        # requests draw a seed from numpy's global RNG. V1 samples seeded requests row by row in Python.
        self.v2_runner = internals.uses_v2_runner(self.llm)
        # A tied head shares the embedding's storage, so the reload's "ParallelLMHead: Failed to load weights"
        # (the head has no tensor of its own in the stream) is noise for it, and only for it.
        self.tied_head = internals.head_is_embedding(self._model())
        internals.install_reload_filter(self.tied_head)
        # Seeded calls: the trainer gives each engine its own range. Unseeded calls: one stream per engine
        # (the ranks of a TP group must draw the same seeds: they run the same requests in lockstep).
        self._engine_id = int(os.environ.get("RANK", "0")) // cfg.rollout.tensor_parallel_size
        self._seeds = random.Random(f"{cfg.rollout.seed}/{self._engine_id}")  # for unseeded calls (V2)
        self.sleep_mode = cfg.rollout.sleep_mode
        # 2: discard weights + KV cache (we reload all weights every step anyway); 1 would copy the
        # weights to pinned CPU memory and back for nothing. Level 2 also discards what vLLM 0.26
        # allocates next to the weights (V2 runner load_model: sampler penalty / logit-bias / bad-word
        # / grammar buffers); our requests use none of those features. Model buffers (e.g. the kv
        # scales, rotary caches) are saved and restored by gpu_worker.Worker.sleep/wake_up.
        self.sleep_level = 2
        self._asleep: set[str] = set()  # subset of {"weights", "kv_cache"}
        self._weights_loaded = False
        self.kv_scales: dict[int, tuple[float, float, float]] = {}  # applied per layer (q, k, v)
        self._warned_q_range = False
        self.last_refit_s = 0.0
        # fp8.kv_cache: a known start, 1.0 until calibrated. The dummy load wrote the same random
        # value into every 0-d scale param, which vLLM 0.26 Fp8KVCacheMethod may have adopted.
        start_kv_scales(self, cfg.fp8, self._attention_layers())

    def _preempted(self) -> None:
        self.preemptions += 1

    # ------------------------------------------------------------------ the engine's model

    def _model(self) -> nn.Module:
        return internals.model(self.llm)

    def _attention_layers(self) -> dict[int, nn.Module]:
        """{decoder layer index: vLLM Attention module}; the modules outlive reloads (only their
        tensors are replaced), so this is computed once."""
        if getattr(self, "_attn", None) is None:
            self._attn = internals.attention_layers(self._model())
        return self._attn

    def _wake(self, tags=("weights", "kv_cache")) -> None:
        todo = [t for t in ("weights", "kv_cache") if t in tags and t in self._asleep]
        if not todo:
            return
        if torch.cuda.is_available():  # the trainer's cached free blocks (activations) back to the driver,
            torch.cuda.empty_cache()   # where vLLM's allocator maps its pools: only live tensors stay out
        self.llm.wake_up(tags=todo)  # vLLM 0.26: partial wake by tag (executor tracks sleeping_tags)
        self._asleep -= set(todo)
        if "weights" in todo:  # waking restores the buffers saved at sleep: apply scales set since
            self._apply_kv_scales()

    # ------------------------------------------------------------------ Engine protocol

    def sleep(self) -> None:
        if not self.sleep_mode or self._asleep == {"weights", "kv_cache"}:
            return
        self._wake()  # vLLM sleeps all or nothing: finish a partial wake first
        self.llm.sleep(level=self.sleep_level)
        self._asleep = {"weights", "kv_cache"}
        if self.sleep_level >= 2:
            self._weights_loaded = False  # discarded; the next update_weights brings them back

    def wake(self) -> None:
        self._wake()

    @torch.no_grad()
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream (HF name, tensor) pairs into vLLM. kv-scale entries ("...layers.{i}...{q,k,v}_scale")
        are taken out of the stream and applied like set_kv_scales. Times the reload (which also
        runs the export generator, i.e. quantization) into self.last_refit_s."""
        self._wake(("weights",))  # KV cache stays asleep: the trainer may still hold its memory
        kv: dict[int, dict[str, float]] = {}

        def stream():
            for name, t in weights:
                if (e := kv_scale_entry(name)) is not None:
                    kv.setdefault(e[0], {}).update(dict.fromkeys(e[1], float(t)))
                elif t.dtype == torch.float32 and not name.endswith("_scale_inv"):
                    yield name, t.to(torch.bfloat16)  # fp32 master weights -> the engine's bf16
                else:
                    yield name, t

        t0 = time.perf_counter()
        # vLLM 0.26 gpu_worker.Worker.reload_weights -> GPUModelRunner.reload_weights(weights_iterator,
        # is_checkpoint_format=True): layerwise reload, process_weights_after_loading per layer, results
        # copied into the original tensors. (model.load_weights on a processed model fails.)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream()})
        torch.cuda.synchronize()
        self.last_refit_s = time.perf_counter() - t0
        self._weights_loaded = True
        for i, d in kv.items():
            old = self.kv_scales.get(i, (1.0, 1.0, 1.0))
            self.kv_scales[i] = tuple(d.get(c, o) for c, o in zip("qkv", old))
        # Reload re-runs Attention.process_weights_after_loading, which resets the scales to 1.0 when
        # the linears are unquantized (vLLM 0.26 attention.py set_default_quant_scales): re-apply.
        self._apply_kv_scales()
        if not self.llm.reset_prefix_cache():  # cached KV was computed by the old weights
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")

    def set_kv_scales(self, scales: dict[int, tuple[float, float, float]]) -> None:
        """Per decoder layer (q_scale, k_scale, v_scale), vLLM's convention x ~= e4m3(x / s) * s
        (s = amax / 448). Applied now if the weights are resident, else on the next wake/update."""
        for i, s in scales.items():
            if len(s) != 3 or not all(0.0 < float(x) < float("inf") for x in s):
                raise ValueError(f"kv scales of layer {i} must be 3 positive finite floats, got {s}")
        self.kv_scales.update({int(i): tuple(float(x) for x in s) for i, s in scales.items()})
        if "weights" not in self._asleep:  # (asleep: sleep already dropped the prefix cache)
            self._apply_kv_scales()
            self.llm.reset_prefix_cache()  # cached fp8 K/V were written with the old scales

    def _apply_kv_scales(self) -> None:
        if not self.kv_scales or not self.cfg.fp8.kv_cache:
            return
        attn = self._attention_layers()
        missing = sorted(set(self.kv_scales) - set(attn))
        if missing:
            raise KeyError(f"kv scales for layers {missing}, but vLLM has attention layers {sorted(attn)}")
        xqa = self.cfg.fp8.kv_attention == "xqa"
        for i, (q, k, v) in self.kv_scales.items():
            a = attn[i]
            if xqa:  # XQA decode casts q to e4m3 unscaled (vllm_internals): prefill must do the same
                if q > 1.0 and not self._warned_q_range:
                    logging.getLogger(__name__).warning(
                        f"fp8.kv_attention=xqa: layer {i}'s calibrated q scale is {q:.3g}, so its q exceeds e4m3's "
                        "448, which XQA's unscaled cast cannot represent; use fp8.kv_attention=fa3")
                    self._warned_q_range = True
                q = 1.0
            internals.write_kv_scales(a, q, k, v)

    @torch.no_grad()
    def generate(self, prompt_ids, n, temperature, top_p, max_new_tokens, seed=None) -> list[Sample]:
        """n samples per prompt, ordered prompt by prompt; Sample.logprobs = the sampled tokens'
        logprobs under log_softmax(logits / temperature) (greedy: under the raw logits).
        seed: makes the call reproducible (V2: per-request seeds; V1: the CUDA RNG, restored after)."""
        if not prompt_ids:
            return []
        if not self._weights_loaded:
            raise RuntimeError("VLLMEngine.generate before update_weights (the engine starts from dummy "
                               "weights, and sleep level 2 discards them)")
        self._wake()
        r = self.cfg.rollout
        lengths = drawn_lengths(len(prompt_ids) * n, r.ignore_eos_median, r.ignore_eos_sigma, max_new_tokens,
                                seed or 0) if r.ignore_eos and r.ignore_eos_median else None
        if self.v2_runner:  # per-request seeds: free in V2, and no draw from the trainer's numpy RNG
            base = seed if seed is not None else self._seeds.getrandbits(62)
            reqs = vllm_requests(prompt_ids, n, temperature, top_p, max_new_tokens, base, r.ignore_eos, lengths)
            outs = self.llm.generate([p for _, p, _ in reqs], [s for _, _, s in reqs], use_tqdm=False)
        else:  # V1 (vLLM 0.26 topk_topp_sampler.random_sample): seeded rows go one by one in Python;
            # unseeded rows use the device's default CUDA generator, in-process ours: seed it for this
            # call, then restore the trainer's RNG state.
            reqs = vllm_requests(prompt_ids, n, temperature, top_p, max_new_tokens, ignore_eos=r.ignore_eos,
                                 lengths=lengths)
            with torch.random.fork_rng(devices=[torch.cuda.current_device()], enabled=seed is not None):
                if seed is not None:
                    torch.cuda.manual_seed(seed)
                outs = self.llm.generate([p for _, p, _ in reqs], [s for _, _, s in reqs], use_tqdm=False)
        samples = []
        for (i, _, _), out in zip(reqs, outs):  # LLM.generate keeps the input order
            for o in sorted(out.outputs, key=lambda o: o.index):
                toks, lp = list(o.token_ids), o.logprobs  # FlatLogprobs: sampled token first per position
                logprobs = [lp.logprobs[s] for s in lp.start_indices]
                assert len(logprobs) == len(toks) and all(lp.token_ids[s] == t for s, t in zip(lp.start_indices, toks))
                if o.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM finished a request with reason {o.finish_reason!r}")
                samples.append(Sample(i, list(prompt_ids[i]), toks, logprobs, o.finish_reason, routed_experts(o)))
        return samples

    # ------------------------------------------------------------------ read-back for tests

    def internal_weight(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """HF parameter name -> (weight, weight_scale_inv or None) as vLLM holds it (clones).

        vLLM fuses q/k/v_proj into qkv_proj and gate/up_proj into gate_up_proj (the model's
        packed_modules_mapping), shards stacked along the output dim in that order; this returns
        the named shard's rows: weight [N, K] (fp8 e4m3fn, or bf16 for unquantized layers) and
        scale [ceil(N/128), ceil(K/128)] fp32. Padded vocab rows of embed_tokens/lm_head are cut.
        Layouts are the cutlass backend's (weight kept [N, K], scales unchanged); deep_gemm
        re-lays-out the scales.
        """
        if not self._weights_loaded:
            raise RuntimeError("no weights loaded")
        self._wake(("weights",))
        model = self._model()
        path = name.removesuffix(".weight")
        parent, _, leaf = path.rpartition(".")
        for fused, parts in getattr(model, "packed_modules_mapping", {}).items():
            if leaf in parts:
                mod = model.get_submodule(f"{parent}.{fused}" if parent else fused)
                sizes = mod.output_partition_sizes  # vLLM 0.26 LinearBase: per-shard output sizes (TP=1)
                idx = parts.index(leaf)
                lo = sum(sizes[:idx])
                hi = lo + sizes[idx]
                break
        else:
            mod = model.get_submodule(path)
            lo, hi = 0, getattr(mod, "org_vocab_size", mod.weight.shape[0])  # VocabParallelEmbedding pads rows
        w = mod.weight
        if hasattr(mod, "input_size_per_partition"):
            assert w.shape[-1] == mod.input_size_per_partition, "unexpected (transposed) weight layout"
        scale = getattr(mod, "weight_scale_inv", None)  # vLLM 0.26 Fp8LinearMethod (block) name
        if scale is not None:
            bn = (getattr(mod, "weight_block_size", None) or [BLOCK])[0]
            scale = scale[lo // bn: -(-hi // bn)].detach().clone()
        return w[lo:hi].detach().clone(), scale

    def internal_expert_weight(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-expert HF name (`model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`, fp8.moe.expert_names)
        -> (weight [n, K], weight_scale_inv [n/128, K/128] or None) as vLLM's FusedMoE holds it (clones).

        vLLM 0.26 FusedMoE: w13_weight [E, 2I, H] (gate rows, then up), w2_weight [E, H, I], block scales
        w13_/w2_weight_scale_inv [E, rows/128, cols/128] (Fp8MoEMethod, block quant). Layouts as the
        Triton / cutlass MoE backends keep them (no shuffling)."""
        self._wake(("weights",))
        path, _, leaf = name.removesuffix(".weight").rpartition(".")
        experts_path, _, e = path.rpartition(".")
        mod, e = self._model().get_submodule(experts_path), int(e)
        mod = getattr(mod, "routed_experts", mod)  # vLLM 0.26: FusedMoE(...) is a MoERunner; its experts hold the weights
        w13 = leaf in ("gate_proj", "up_proj")
        w = (mod.w13_weight if w13 else mod.w2_weight)[e]
        scale = getattr(mod, "w13_weight_scale_inv" if w13 else "w2_weight_scale_inv", None)
        scale = None if scale is None else scale[e]
        if w13:
            half = w.shape[0] // 2
            lo = 0 if leaf == "gate_proj" else half
            w = w[lo:lo + half]
            if scale is not None:
                scale = scale[lo // BLOCK: (lo + half) // BLOCK]
        return w.detach().clone(), None if scale is None else scale.detach().clone()

    def internal_kv_scales(self) -> dict[int, tuple[float, float, float]]:
        """{layer: (q, k, v)} read back from vLLM's attention scale tensors."""
        self._wake(("weights",))
        return {i: internals.read_kv_scales(a) for i, a in sorted(self._attention_layers().items())}
