"""Every vLLM internal the recipe touches, in one module, checked before an engine starts.

The recipe drives vLLM through its public API: `vllm.LLM` with EngineArgs keywords, SamplingParams,
`sleep` / `wake_up`, `reset_prefix_cache`, and the layerwise `reload_weights` (vLLM's documented refit
for RL, reached through `collective_rpc`). What that API does not offer is here, each as an `Internal`
(module, owner, member) read from vLLM 0.26.0's source:

- model access (the in-process worker's `get_model()`): FP8 KV scale writes and test read-back;
- the attention layers' q/k/v scale tensors: per-step recalibration writes them in place, so CUDA
  graphs keep reading the live values (vLLM 0.34 also takes them under their checkpoint names
  through the reload; 0.26 does not);
- FlashInfer's XQA decode with scales read from those tensors (`patch_xqa_scales`);
- the scheduler's preemption hook (a metric: `rollout/preemptions`);
- the reload's logger (one known warning per refit is dropped, `quiet_reload`).

`missing()` checks them against vLLM's *source* with `ast` (no import, so it also reads a newer
wheel's unpacked source: scripts/vllm_upgrade_check.py); `check_installed(cfg)` runs it on the installed
vLLM before the engine starts and fails with one line naming the version and the internal. Nothing
else in the recipe reaches into vLLM's engine, engine-core or worker objects; benchmarks come here too.
docs/vllm_upgrade.md says what changes on newer releases.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from errors import UserError
from fp8.plan import LAYER_RE  # `layers.<i>.` in module names

VERIFIED = "0.26.0"  # the release every Internal below was read from (requirements.txt pins it)


@dataclass(frozen=True)
class Internal:
    """A name in vLLM's source the recipe relies on: `owner` (a class, function or imported name) defined
    at the top of `module`; with `member`, an attribute of it (a method or class attribute, or one the
    module assigns: `self.member = ...`, `layer.member = ...`, `register_buffer("member", ...)`)."""
    use: str
    module: str
    owner: str
    member: str = ""
    when: str = "engine"  # engine | kv_cache (fp8.kv_cache) | xqa (fp8.kv_attention=xqa) | metric | bench | test

    def __str__(self) -> str:
        return f"{self.module}:{self.owner}{'.' + self.member if self.member else ''}"


ENGINE = "vllm.v1.engine.llm_engine"
WORKER = "vllm.v1.worker.gpu_worker"
ATTN = "vllm.model_executor.layers.attention.attention"
FLASHINFER = "vllm.v1.attention.backends.flashinfer"
RELOAD = "vllm.model_executor.model_loader.reload.layerwise"

INTERNALS = (
    Internal("model access", ENGINE, "LLMEngine", "model_executor"),
    Internal("model access", "vllm.v1.executor.uniproc_executor", "UniProcExecutor", "driver_worker"),
    Internal("model access", "vllm.v1.worker.worker_base", "WorkerWrapperBase", "worker"),
    Internal("model access", WORKER, "Worker", "get_model"),
    Internal("weight refit (layerwise reload)", WORKER, "Worker", "reload_weights"),
    Internal("reload warnings", RELOAD, "finalize_layerwise_processing"),
    Internal("attention layers", "vllm.model_executor.layers.attention", "Attention"),
    *(Internal("kv scale writes", ATTN, "Attention", m, "kv_cache") for m in (
        "_q_scale", "_k_scale", "_v_scale", "_q_scale_float", "_k_scale_float", "_v_scale_float",
        "_k_scale_cpu", "_v_scale_cpu")),
    Internal("XQA decode scales", FLASHINFER, "FlashInferImpl", "forward", "xqa"),
    Internal("XQA decode scales", FLASHINFER, "FlashInferImpl", "get_xqa_bmm1_scale", "xqa"),
    Internal("XQA decode scales", FLASHINFER, "FlashInferImpl", "bmm2_scale", "xqa"),
    Internal("XQA decode scales", FLASHINFER, "is_quantized_kv_cache", when="xqa"),
    Internal("XQA decode call that tests/unit/test_xqa.py records", FLASHINFER, "trtllm_batch_decode_with_kv_cache",
             when="test"),
    Internal("XQA availability", "vllm.utils.flashinfer", "supports_trtllm_attention", when="xqa"),
    Internal("preemption count", ENGINE, "LLMEngine", "engine_core", "metric"),
    Internal("preemption count", "vllm.v1.engine.core_client", "InprocClient", "engine_core", "metric"),
    Internal("preemption count", "vllm.v1.engine.core", "EngineCore", "scheduler", "metric"),
    Internal("preemption count", "vllm.v1.core.sched.scheduler", "Scheduler", "_preempt_request", "metric"),
    Internal("sampler seeding (V1 vs V2 runner)", "vllm.config.vllm", "VllmConfig", "use_v2_model_runner", "metric"),
    Internal("KV capacity read-back", WORKER, "Worker", "available_kv_cache_memory_bytes", "bench"),
    Internal("host time per decode step", "vllm.v1.engine.core", "EngineCore", "step_fn", "bench"),
    Internal("host time per decode step", ENGINE, "LLMEngine", "output_processor", "bench"),
    # the engine's weights read back by the GPU tests (VLLMEngine.internal_weight / internal_expert_weight)
    Internal("weight read-back", "vllm.model_executor.layers.linear", "ColumnParallelLinear", "output_partition_sizes",
             "test"),
    Internal("weight read-back", "vllm.model_executor.layers.vocab_parallel_embedding", "VocabParallelEmbedding",
             "org_vocab_size", "test"),
    Internal("weight read-back", "vllm.model_executor.layers.quantization.fp8", "Fp8LinearMethod", "weight_scale_inv",
             "test"),
    Internal("weight read-back", "vllm.model_executor.layers.quantization.fp8", "Fp8MoEMethod", "w13_weight", "test"),
)


def needed(cfg) -> list[Internal]:
    """The internals an engine for this config relies on (metric ones degrade instead of failing)."""
    f = cfg.fp8
    on = {"engine", "kv_cache" if f.kv_cache else "", "xqa" if f.kv_cache and f.kv_attention == "xqa" else ""}
    return [i for i in INTERNALS if i.when in on]


# ------------------------------------------------------------------------------- source check (ast)


def installed_source() -> Path:
    """The directory holding the installed `vllm/` package (found without importing it)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("rollout.engine=vllm but vllm is not installed (pip install vllm==0.26.0)")
    return Path(list(spec.submodule_search_locations)[0]).parent


@functools.lru_cache(maxsize=None)
def _names(path: Path) -> tuple[dict[str, set[str]], set[str]]:
    """({top-level name: its members}, attribute names the module assigns anywhere) for one file.
    A class's members are its methods, class attributes and `self.x` assignments; other top-level
    names (functions, imports, assignments) have none. Assigned anywhere: `obj.x = ...` and the names given
    to register_buffer / register_parameter."""
    tree = ast.parse(path.read_text())
    top: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            members = set()
            for sub in ast.walk(node):
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and sub in node.body:
                    members.add(sub.name)
                elif isinstance(sub, (ast.Assign, ast.AnnAssign)):
                    for t in sub.targets if isinstance(sub, ast.Assign) else [sub.target]:
                        if isinstance(t, ast.Name) and sub in node.body:
                            members.add(t.id)
                        elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                            members.add(t.attr)
            top[node.name] = members
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            top[node.name] = set()
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            top.update({(a.asname or a.name).split(".")[0]: set() for a in node.names})
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Name):
                    top[t.id] = set()
    assigned = set()
    for sub in ast.walk(tree):
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
            assigned.add(sub.attr)
        elif (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute)
              and sub.func.attr in ("register_buffer", "register_parameter") and sub.args
              and isinstance(sub.args[0], ast.Constant)):
            assigned.add(sub.args[0].value)
    return top, assigned


def _module_file(root: Path, module: str) -> Path | None:
    base = root.joinpath(*module.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def missing(root: Path, internals=INTERNALS) -> list[tuple[Internal, str]]:
    """[(internal, what is missing)] for the vLLM source tree under `root` (the dir holding `vllm/`)."""
    out = []
    for i in internals:
        path = _module_file(root, i.module)
        if path is None:
            out.append((i, f"no module {i.module}"))
            continue
        top, assigned = _names(path)
        if i.owner not in top:
            out.append((i, f"{i.module} has no {i.owner}"))
        elif i.member and i.member not in top[i.owner] and i.member not in assigned:
            out.append((i, f"{i.module}.{i.owner} has no {i.member}"))
    return out


def vllm_version() -> str:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def check_installed(cfg) -> None:
    """Before an engine starts: every internal this config needs is in the installed vLLM, else a
    UserError naming the version and the first missing internal."""
    gone = missing(installed_source(), needed(cfg))
    if gone:
        i, why = gone[0]
        more = f" (and {len(gone) - 1} more: scripts/vllm_upgrade_check.py lists them)" if len(gone) > 1 else ""
        raise UserError(f"vLLM {vllm_version()}: {why}, which the recipe uses for {i.use} ({i}){more}; "
                        f"the recipe is verified with vLLM {VERIFIED} (requirements.txt, docs/vllm_upgrade.md)")


# ------------------------------------------------------------------------------- live objects


def worker(llm):
    """The in-process GPU worker (VLLM_ENABLE_V1_MULTIPROCESSING=0 or torchrun's external launcher)."""
    return llm.llm_engine.model_executor.driver_worker.worker


def model(llm) -> nn.Module:
    """The engine's model (Worker.get_model unwraps CUDA-graph wrappers)."""
    return worker(llm).get_model()


def engine_core(llm):
    """The in-process EngineCore (scheduler, model executor, step_fn)."""
    return llm.llm_engine.engine_core.engine_core


def uses_v2_runner(llm) -> bool:
    """Model Runner V2 (per-request seeds in one Gumbel kernel) or V1 (seeded rows one by one in Python).
    0.26 picks per model (VllmConfig.use_v2_model_runner); releases without the property have only V2."""
    return bool(getattr(llm.llm_engine.vllm_config, "use_v2_model_runner", True))


def attention_layers(m: nn.Module) -> dict[int, nn.Module]:
    """{decoder layer index: vLLM Attention module} (model.layers.{i}.self_attn.attn)."""
    from vllm.model_executor.layers.attention import Attention

    return {int(g.group(1)): mod for name, mod in m.named_modules()
            if isinstance(mod, Attention) and (g := LAYER_RE.search(name))}


def write_kv_scales(attn: nn.Module, q: float, k: float, v: float) -> None:
    """In place into one Attention layer. Its _q/_k/_v_scale are 0-d fp32 device buffers that FA3 reads at
    launch, reshape_and_cache_flash divides k/v by and QuantFP8 quantizes q with, so fill_ keeps CUDA graphs
    valid; the host mirrors are read by other backends (FlashInfer, ROCm): kept in sync."""
    attn._q_scale.fill_(q)
    attn._k_scale.fill_(k)
    attn._v_scale.fill_(v)
    attn._q_scale_float, attn._k_scale_float, attn._v_scale_float = q, k, v
    attn._k_scale_cpu.fill_(k)
    attn._v_scale_cpu.fill_(v)


def read_kv_scales(attn: nn.Module) -> tuple[float, float, float]:
    return attn._q_scale.item(), attn._k_scale.item(), attn._v_scale.item()


def count_preemptions(llm, on_preempt) -> bool:
    """Call on_preempt() each time vLLM preempts a sequence (its KV cache is full: the sequence goes back to
    the queue and is recomputed later); False where the scheduler's hook is not there."""
    try:
        scheduler = engine_core(llm).scheduler
        preempt = scheduler._preempt_request
    except AttributeError:
        return False

    def counted(*args, **kwargs):
        on_preempt()
        return preempt(*args, **kwargs)

    scheduler._preempt_request = counted
    return True


def head_is_embedding(m: nn.Module) -> bool:
    """A tied model's lm_head holds the embedding's own storage (vLLM's ParallelLMHead.tie_weights), so a
    refit of the embedding is a refit of the head."""
    head, embed = getattr(m, "lm_head", None), getattr(getattr(m, "model", None), "embed_tokens", None)
    return (head is not None and embed is not None and hasattr(head, "weight")
            and head.weight.data_ptr() == embed.weight.data_ptr() and head.weight.shape == embed.weight.shape)


# ------------------------------------------------------------------------------- reload warnings


RELOAD_LOGGER = RELOAD  # the layerwise reload logs under its module name


class quiet_reload(logging.Filter):
    """Drops the reload's "<Layer>: Failed to load weights" for layers the HF state dict has no tensor for, and
    that vLLM restores on its own: RotaryEmbedding (its cos/sin cache is put back) and, only for a model whose
    head was seen to share the embedding's storage (head_is_embedding), ParallelLMHead. Every other record
    passes."""

    def __init__(self, tied_head: bool = False):
        super().__init__()
        self.layers = ("RotaryEmbedding", "ParallelLMHead") if tied_head else ("RotaryEmbedding",)

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args and record.args[0] in self.layers)


def install_reload_filter(tied_head: bool) -> quiet_reload:
    log = logging.getLogger(RELOAD_LOGGER)
    for f in [f for f in log.filters if isinstance(f, quiet_reload)]:
        log.removeFilter(f)  # one per process: the latest engine's
    f = quiet_reload(tied_head)
    log.addFilter(f)
    return f


# ------------------------------------------------------------------------------- XQA decode (fp8.kv_attention=xqa)
#
# vLLM 0.26's FlashInfer backend already decodes an FP8 cache with XQA on SM90 (FlashInferImpl, backend="xqa"),
# but passes the kernel host floats: bmm1 = softmax scale x k_scale, recomputed from the float mirror at each
# call (so frozen into a CUDA graph at capture), and bmm2 = v_scale, cached at the first forward and never read
# again. The trainer recalibrates q/k/v scales every step by writing the device tensors in place
# (write_kv_scales), so both must come from those tensors; flashinfer's trtllm_batch_decode_with_kv_cache takes
# a float or a 0-d fp32 tensor for each. No vLLM option passes tensors, hence the patch. Why XQA: its decode
# over the FP8 cache is the fastest measured (docs/results.md, "FP8 decode attention kernels with scales on
# the device").
#
# XQA on SM90 casts the BF16 q to e4m3 with no scale (flashinfer's mha_sm90.cu), so in this mode the engine sets
# q_scale to 1: FlashInfer's FP8 prefill, which quantizes q with it, then agrees with decode.

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def patch_xqa_scales() -> None:
    """FlashInferImpl's XQA decode reads k/v scales from the layer's device tensors (idempotent).
    Call before the engine is built, so that CUDA-graph capture sees the patched calls."""
    from vllm.v1.attention.backends import flashinfer as fib

    impl = fib.FlashInferImpl
    if getattr(impl, "_device_scales", False):
        return
    forward = impl.forward

    def get_xqa_bmm1_scale(self, layer, q_data_type):
        # a 0-d fp32 tensor made at launch: inside a CUDA graph this product is a captured kernel
        # reading layer._k_scale, so write_kv_scales' fill_ reaches every replay without a host sync
        s = layer._k_scale * self.scale
        return s * layer._q_scale if q_data_type in FP8 else s

    def forward_with_device_scales(self, layer, *args, **kwargs):
        if fib.is_quantized_kv_cache(self.kv_cache_dtype):
            self.bmm2_scale = layer._v_scale  # the tensor itself (vLLM caches a float here once)
        return forward(self, layer, *args, **kwargs)

    impl.get_xqa_bmm1_scale = get_xqa_bmm1_scale
    impl.forward = forward_with_device_scales
    impl._device_scales = True


def xqa_unavailable() -> str | None:
    """Why XQA decode is not available on this process's GPU, or None. Call after vLLM's environment is set
    (engines.vllm.vllm_env sets VLLM_HAS_FLASHINFER_CUBIN, without which vLLM probes NVIDIA's artifact server
    and, offline, silently decodes with FlashInfer's native kernel and frozen scales)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return "it needs an SM90 GPU (H100/H200); use fp8.kv_attention=fa3"
    from vllm.utils.flashinfer import supports_trtllm_attention

    if not supports_trtllm_attention(is_prefill=False):
        return "vLLM does not offer the XQA decode kernel here (VLLM_BATCH_INVARIANT set, or flashinfer unusable)"
    return None
