"""The engine's q/k/v scales (FP8 KV cache): calibrated from trainer forwards through one hook on HF
attention, handed to the engine, kept in checkpoints. This module owns them over a run:

    calibrator = make_calibrator(model, cfg.fp8)   # fp8.kv_cache + fp8.recalibrate, else None
    start_kv_scales(engine, cfg.fp8, layers)        # an engine's start: 1.0 until calibrated
    send_kv_scales(engine, cfg.fp8, scales)         # after each calibration (the one fp8.kv_cache guard)
    meta.update(kv_scales_state(scales)); kv_scales_from_state(meta)   # a checkpoint's meta.pt entry

vLLM's FP8 KV cache stores k/v as e4m3(k / k_scale) with ONE static scale per layer (and its
FP8 attention also quantizes q with q_scale), so the scales must cover the range of the current
policy's post-RoPE q/k/v. We measure that range where it is cheapest: in the trainer's own
forward passes, which already compute exactly those tensors.

Mechanism: transformers 5 dispatches attention through `ALL_ATTENTION_FUNCTIONS[config.
_attn_implementation](module, query, key, value, attention_mask, ...)` with post-RoPE
query [B, H, T, D] and key/value [B, Hkv, T, D] (Llama, Qwen3: q_norm/k_norm are applied before
RoPE, so also included). `install(model)` re-registers (AttentionInterface.register) the model's
implementation name (sdpa, eager, flash_attention_*) as a wrapper around the function it had
(for eager: the model file's own eager_attention_forward). The name is kept, so masks and the
flash-attention kernel selection, which key on it, are untouched. The wrapper looks at a small
state object on each attention module (`module._fp8_qkv`); modules without one (any other model
in the process) pass straight through. With a state it
  (a) while a QKVCalibrator captures: max-reduces max|q|, max|k|, max|v| into that module's
      state.amax [3] (device tensor, in place, no sync), the current micro-batch's record;
  (b) when the state has a transform: replaces q, k, v by transform(q, k, v) before calling the
      real attention (engines/hf.py: the CPU engine's emulation of vLLM's FP8 KV cache +
      attention, which fake-quantizes them with the per-layer scales).
Idle cost: one getattr per attention call. Recording runs under no_grad on detached tensors, so
gradients are untouched. Recording is an in-place tensor update, which torch.compile traces: a
train.compile'd trainer calibrates inside its compiled layers (one more graph variant per layer:
recording on/off).

Micro-batches: a forward pre-hook on the model (eager: outside the compiled layers) closes the
previous record (stacks the modules' amax into an [L, 3] record and zeroes them) and starts a new
one, so gradient-checkpoint recomputation (attention runs again in backward) max-reduces into the
same record. Padding: when
the model is called with a 2-D attention_mask [B, T] matching q/k/v, padded positions are
excluded from the amax (pad embeddings are finite but not representative); packed inputs
(no mask) use every position.

scales() = percentile over micro-batches of amax (linear interpolation, numpy's default) *
margin / 448 per layer and tensor, max-reduced across ranks when torch.distributed is
initialized (collective: every rank must call it). Scale convention = vLLM's: x ~= e4m3(x/s)*s.
"""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, Callable, Iterable

import torch
from torch import Tensor, nn

from fp8.quant import FP8_MAX
from models import attention_modules

if TYPE_CHECKING:
    from config import FP8Config

KVScales = dict[int, tuple[float, float, float]]  # {decoder layer: (q_scale, k_scale, v_scale)}


class _State:
    """Per attention module: who records, and what replaces q, k, v before attention."""

    __slots__ = ("calibrator", "amax", "transform")

    def __init__(self):
        self.calibrator: QKVCalibrator | None = None
        self.amax: Tensor | None = None  # [3] max|q|, max|k|, max|v| of the open record
        # (q, k, v) -> (q, k, v) before attention, e.g. engines.hf.FP8QKV (FP8 attention emulation)
        self.transform: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]] | None = None


def _own_eager(module: nn.Module):
    """The eager attention function of the module's own modeling file (Llama's as a fallback)."""
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as fn
    return fn


def _wrap(impl: str) -> None:
    """Make ALL_ATTENTION_FUNCTIONS[impl] the fp8qkv wrapper around what it was (idempotent)."""
    from transformers.modeling_utils import AttentionInterface

    orig = AttentionInterface._global_mapping.get(impl)  # None for "eager": each model has its own
    if getattr(orig, "_fp8qkv_wrapper", False):
        return

    def fp8qkv_attention(module, query, key, value, attention_mask, **kwargs):
        st = getattr(module, "_fp8_qkv", None)
        if st is not None:
            if st.calibrator is not None:
                st.calibrator._record(st, query, key, value)
            if st.transform is not None:
                query, key, value = st.transform(query, key, value)
        fn = orig if orig is not None else _own_eager(module)
        return fn(module, query, key, value, attention_mask, **kwargs)

    fp8qkv_attention._fp8qkv_wrapper = True
    fp8qkv_attention.__name__ = f"fp8qkv_{impl}"
    AttentionInterface.register(impl, fp8qkv_attention)


def install(model: nn.Module) -> dict[int, nn.Module]:
    """Wrap the model's attention implementation and give its attention modules a state
    (idempotent; also re-wraps if something re-registered the implementation); {layer: module}."""
    impl = model.config._attn_implementation or "eager"
    if impl.startswith("paged|"):
        raise ValueError(f"fp8 q/k/v capture/emulation does not support attn_implementation={impl!r}")
    _wrap(impl)
    mods = attention_modules(model)
    if not mods:
        raise ValueError(f"no attention modules found ({type(model).__name__}: models.family_of(model) names "
                         "its decoder layers and their attention child)")
    for m in mods.values():
        if getattr(m, "_fp8_qkv", None) is None:
            m._fp8_qkv = _State()
    return mods


def uninstall(model: nn.Module) -> None:
    """Drop the model's transform and calibrator state; its attention is then plain again (the
    global wrapper stays registered and passes modules without state straight through)."""
    for m in attention_modules(model).values():
        m.__dict__.pop("_fp8_qkv", None)


_token_mask: Tensor | None = None  # set by token_mask(): real tokens of a forward run without its mask


@contextlib.contextmanager
def token_mask(mask: Tensor | None):
    """The real tokens ([B, T], nonzero) of the forwards inside, for a model called without its
    attention mask (batch.token_logprobs); the calibrator leaves the others out of its amax."""
    global _token_mask
    prev, _token_mask = _token_mask, mask
    try:
        yield
    finally:
        _token_mask = prev


def _masked_amax(t: Tensor, mask: Tensor | None) -> Tensor:
    """max|t| of t [B, H, T, D] over positions where mask [B, T] is nonzero (all if no mask fits).

    Two reductions, per position over heads and channels, then over the [B, T] positions: the same
    value, but inside a compiled layer of dynamic length inductor made one whole-tensor reduction of
    the masked form slow (Llama-3.1-8B at 4 x ~1,700 tokens: 0.42 ms per layer for q, 0.1 ms for k and v,
    ~17 ms per micro-batch of the shipped logprobs pass on an H200)."""
    per_position = t.detach().abs().amax(dim=(1, 3))  # [B, T]
    if mask is not None and mask.shape == per_position.shape:
        per_position = torch.where(mask.to(t.device, torch.bool), per_position, 0)
    return per_position.amax().float()


def scales_from_amax(amax: Tensor, percentile: float, margin: float,
                     layers: list[int] | None = None) -> dict[int, tuple[float, float, float]]:
    """amax [n_microbatches, L, 3] -> {layer: (q, k, v) scale} = quantile_p(amax) * margin / 448.

    Max-reduced over ranks if torch.distributed is initialized (collective). `layers` selects
    the rows to return (default: all). Scales are floored at 1e-12 so none is ever 0.
    """
    p = torch.quantile(amax.double(), percentile / 100.0, dim=0)  # [L, 3]
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "nccl" and p.device.type != "cuda":
            p = p.cuda()
        dist.all_reduce(p, op=dist.ReduceOp.MAX)
    s = (p * margin / FP8_MAX).clamp(min=1e-12).float().cpu().tolist()  # fp32, as vLLM stores them
    return {i: tuple(s[i]) for i in (range(len(s)) if layers is None else layers)}


class QKVCalibrator:
    """Records per-layer max|q|, max|k|, max|v| of trainer forwards; scales() for vLLM.

        calib = QKVCalibrator(model, cfg.fp8.calib_percentile, cfg.fp8.calib_margin)
        with calib.capture():          # every model forward inside = one micro-batch record
            ...train step...
        kv_scales = calib.scales()     # {layer: (q_scale, k_scale, v_scale)}
    """

    def __init__(self, model: nn.Module, percentile: float = 99.9, margin: float = 1.05):
        self.model, self.percentile, self.margin = model, percentile, margin
        self._mods = install(model)
        self.num_layers = max(self._mods) + 1
        self._records: list[Tensor] = []  # each [L, 3] float32 on the model's device
        self._open = False  # a model forward recorded into the modules' amax: a record not yet in _records
        self._mask: Tensor | None = None
        self._layers: Tensor | None = None  # the recorded layers' indices, on the device while capturing

    def reset(self) -> None:
        self._records.clear()
        self._open = False

    @contextlib.contextmanager
    def capture(self, reset: bool = True):
        """Record while inside; reset=True forgets earlier records first."""
        if reset:
            self.reset()
        device = next(self.model.parameters()).device
        hook = self.model.register_forward_pre_hook(self._on_forward, with_kwargs=True)
        for m in self._mods.values():
            m._fp8_qkv.calibrator = self
            m._fp8_qkv.amax = torch.zeros(3, device=device)
        # made once: indexing with a Python list would copy it to the GPU in every _close, and a copy
        # from pageable host memory waits for the stream (a host sync per micro-batch)
        self._layers = torch.tensor(list(self._mods), device=device)
        try:
            yield self
        finally:
            hook.remove()
            self._close()
            for m in self._mods.values():
                m._fp8_qkv.calibrator = m._fp8_qkv.amax = None
            self._mask = None

    def _close(self) -> None:
        """Move the open record into _records ([L, 3]; layers without attention 0) and zero the buffers."""
        if self._open:
            amax = [m._fp8_qkv.amax for m in self._mods.values()]
            rec = torch.zeros(self.num_layers, 3, device=amax[0].device)
            rec.index_copy_(0, self._layers, torch.stack(amax))
            torch._foreach_zero_(amax)
            self._records.append(rec)
        self._open = False

    def _on_forward(self, module, args, kwargs):
        self._close()
        self._open = True
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        mask = _token_mask if mask is None else mask
        self._mask = mask if isinstance(mask, Tensor) and mask.dim() == 2 else None

    @torch.no_grad()
    def _record(self, st: _State, q: Tensor, k: Tensor, v: Tensor) -> None:
        amax = torch.stack([_masked_amax(t, self._mask) for t in (q, k, v)])
        st.amax.copy_(torch.maximum(st.amax, amax))

    def amax(self) -> Tensor:
        """[n_microbatches, L, 3] float32 (CPU): max|q|, max|k|, max|v| per record and layer."""
        if not self._records:
            raise RuntimeError("QKVCalibrator: nothing captured (run forwards inside capture())")
        return torch.stack(self._records).cpu()

    def scales(self) -> dict[int, tuple[float, float, float]]:
        """{layer: (q_scale, k_scale, v_scale)}; collective across ranks when distributed."""
        if not self._records:
            raise RuntimeError("QKVCalibrator: nothing captured (run forwards inside capture())")
        return scales_from_amax(torch.stack(self._records), self.percentile, self.margin, sorted(self._mods))


# ----------------------------------------------------------------------------- the scales over a run

def make_calibrator(model: nn.Module, cfg: FP8Config) -> QKVCalibrator | None:
    """The trainer's calibrator, with fp8.kv_cache and fp8.recalibrate; None: the engine keeps the scales
    it has (its start, or a checkpoint's)."""
    if not (cfg.kv_cache and cfg.recalibrate):
        return None
    return QKVCalibrator(model, cfg.calib_percentile, cfg.calib_margin)


def send_kv_scales(engine, cfg: FP8Config, scales: KVScales | None) -> None:
    """engine.set_kv_scales(scales) where they apply: an engine with an FP8 KV cache (fp8.kv_cache; a BF16
    cache has no scales) and scales to give (None: none calibrated yet). Every hand-off goes through here."""
    if cfg.kv_cache and scales is not None:
        engine.set_kv_scales(scales)


def start_kv_scales(engine, cfg: FP8Config, layers: Iterable[int]) -> None:
    """An engine's scales until calibrated ones arrive: 1.0 for each layer and tensor, as vLLM starts."""
    send_kv_scales(engine, cfg, {i: (1.0, 1.0, 1.0) for i in layers})


def kv_scales_state(scales: KVScales | None) -> dict:
    """The scales' entry in a checkpoint's meta.pt (checkpoint.py): the last calibration's, None before one."""
    return {"kv_scales": scales}


def kv_scales_from_state(meta: dict) -> KVScales | None:
    """The scales a checkpoint's meta.pt keeps (kv_scales_state); None: the run calibrated none."""
    return meta.get("kv_scales")
