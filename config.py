"""Run configuration: nested dataclasses, YAML files with `base:` inheritance, CLI overrides.

    cfg = load_config("configs/tiny_cpu.yaml", ["loss.is_cap=5", "fp8.kv_cache=true"])

* A YAML file may name `base: other.yaml` (relative to itself); its keys are merged on top.
* Overrides are `section.field=value`. The value is parsed as YAML (`true`, `3e-7`, `[a, b]`,
  `null`), except for a str field, which takes the text as it is (`data.answer_regex=#### (.*)`).
* `validate` rejects settings that would stop or reverse learning (lr <= 0, max_grad_norm=0, ...).
* Unknown keys, wrong types and bad enum values raise `ConfigError` naming the key, so a typo
  fails at start-up instead of an hour into a run.

Every field carries its doc as an attribute docstring (the string on the line below it). A component's
settings live beside it (`fp8/config.py`, `rollout.py`'s RolloutConfig, `losses/`'s LossConfig and
AdvantageConfig); this module assembles them into `Config`, loads and checks them.
"""

import dataclasses
import functools
import math
import re
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import yaml

from errors import UserError
from losses.advantages import ADVANTAGE_REGISTRY, AdvantageConfig
from losses.grpo import LossConfig, is_weights
from models import FAMILIES
from fp8.config import FP8Config
from rewards import REWARDS
from rollout import RolloutConfig


class ConfigError(UserError):
    pass


@dataclass
class TinyModelConfig:
    arch: str = "llama"
    """Architecture of the model built from scratch when model.name_or_path is 'tiny': a registered
    model family (models/<family>.py, e.g. "llama", "qwen3")."""
    hidden_size: int = 128
    """Width; keep a multiple of 128 so the block FP8 linears apply."""
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 32
    max_position_embeddings: int = 512
    vocab: str = "0123456789+-*=?() \n"
    """Characters of the char-level tokenizer the repo builds (plus <pad>, <bos>, <eos>)."""
    vocab_size: int = 0
    """0 = the tokenizer's size. Larger pads embeddings and lm_head to a real model's vocab (speed
    benchmarks at real shapes; ids past the tokenizer's decode to nothing)."""
    num_experts: int = 0
    """Mixture-of-experts families (arch qwen3_moe): experts per layer (>= 2); 0 for a dense family."""
    num_experts_per_tok: int = 2
    """MoE: experts each token is routed to (the router's top-k), 1 to num_experts."""
    moe_intermediate_size: int = 128
    """MoE: each expert's SwiGLU width; keep a multiple of 128 so the expert GEMMs are block FP8."""


@dataclass
class ModelConfig:
    name_or_path: str = "tiny"
    """Hub id (e.g. meta-llama/Llama-3.1-8B-Instruct), a local HF model dir, or 'tiny'
    (built from model.tiny with a char tokenizer the repo writes; downloads nothing)."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    dtype: Literal["bfloat16", "float32"] = "float32"
    """Parameter (master weight) dtype of the trainer. float32 on CUDA = fp32 master weights with
    forward/backward under bf16 autocast; bfloat16 = pure bf16. A bf16 weight ignores a round-to-
    nearest update below half its ulp (~6e-5 at |w| ~ 0.02), which at RL learning rates is nearly
    every update, at any model size: bfloat16 needs optim.bf16_stochastic_round or an lr >= 1e-4
    (optimizer.py has the arithmetic)."""
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"
    """'auto' = flash_attention_2 when flash-attn is installed, else PyTorch SDPA."""
    cudnn_sdpa: bool = False
    """true: PyTorch SDPA may pick cuDNN's attention kernel in the trainer on the GPU; false: its
    FlashAttention-2 kernel, as vLLM's CUDA platform import leaves the process (modeling.pin_sdpa_backends).
    cuDNN's kernel is faster once its plan for a shape is cached, but builds a plan for every new micro-batch
    length, so the shipped steps gained nothing from it and it stays off
    (docs/results.md#cudnn-attention-in-the-shipped-steps-no-gain-a-plan-for-every-new-length-2026-11-29-nvidia-h200-141-gb);
    numerics and the learning gate are checked with it on."""
    gradient_checkpointing: bool = False
    gradient_checkpointing_every: int = 1
    """With gradient_checkpointing: checkpoint every n-th decoder layer (layers 0, n, 2n, ...: transformers'
    every_n_layers); the others keep their activations for backward, trading memory back for the recompute.
    1: every layer."""


@dataclass
class SyntheticConfig:
    num_train: int = 2000
    num_val: int = 200
    difficulty: int = 1
    """1: a+b with a,b < 5; 2: a+b, a-b with a,b < 10; 3: two-digit +,- (results >= 0 so far);
    4: +,-,* up to 99 (negatives allowed); 5: three-term expressions."""
    disjoint_val: bool = True
    """Val questions never appear in train (held-out generalisation). Tiny question spaces
    (difficulty 1 has 25) need false to get a val set larger than a fifth of the space."""
    seed: int = 0


@dataclass
class DataConfig:
    source: Literal["synthetic", "jsonl", "hf"] = "synthetic"
    path: str = ""
    """HF datasets id (source=hf) or path of a JSONL file (source=jsonl)."""
    hf_config: str = ""
    """Dataset config name for datasets.load_dataset (e.g. 'main' for gsm8k)."""
    train_split: str = "train"
    val_split: str = ""
    """Split used for validation; '' holds out data.val_size examples of the train split."""
    val_size: int = 200
    prompt_field: str = "problem"
    answer_field: str = "answer"
    answer_regex: str = ""
    """Optional regex whose first group extracts the answer from answer_field (gsm8k: '#### (.*)';
    on the command line `data.answer_regex='#### (.*)'` is taken as written, '#' included)."""
    answer_boxed: bool = False
    """Take the answer from the last \\boxed{...} of answer_field (MATH's `solution` column)."""
    template: Literal["auto", "chat", "plain"] = "auto"
    """'auto' uses the tokenizer's chat template when it has one, else the plain template."""
    system_prompt: str = ""
    instruction: str = ""
    """Appended to each question, e.g. 'Put your final answer within \\boxed{}.'"""
    max_prompt_tokens: int = 512
    """Longer prompts are dropped (and counted)."""
    reward: str = "math"
    """The reward each completion scores, by name in rewards.REWARDS: 'math' (the final answer equals
    the gold answer per math-verify; rewards.py's rules), 'format' (it states an answer in a \\boxed{},
    right or not). reward/accuracy and val/accuracy are its mean."""
    format_reward: float = 0.0
    """Extra reward for a completion that states its answer in \\boxed{} (0 = off)."""
    reward_last_number: bool | None = None
    """Score the last number in a completion that states no answer (no \\boxed{}, no "answer is" /
    "Answer:" line, not a bare number). Easy to game (a cut-off "...36, then 36 +" would read 36),
    so off for real data; None = on for source=synthetic only (its worked solutions end in the
    answer). This lenient mode also scores output cut at rollout.max_new_tokens by its text.
    rewards.py documents every rule."""
    max_examples: int = 0
    """Read at most this many rows of the train split (0 = all). For a hub id the rows are streamed
    (datasets streaming + take), so a 1M-row dataset is not downloaded whole."""
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    seed: int = 0


@dataclass
class MoEConfig:
    """Mixture-of-experts models (a family with experts, e.g. qwen3_moe); routing.py has the mechanism."""
    aux_loss_coef: float = 0.0
    """Weight of the Switch-Transformer load-balancing loss (Fedus et al. 2021; HF's router_aux_loss_coef,
    0.001 in Qwen3-MoE pre-training) added to the policy loss, over the routers of the policy forward
    and the real tokens. It keeps experts evenly used; RL fine-tuning usually leaves it at 0 (the
    reward, not balance, is the objective). Must be 0 for a dense model."""
    router_replay: bool = False
    """Routing replay (verl's R3, NeMo RL): the trainer's old_logp and policy forwards route each token
    to the top-k experts the engine chose in the rollout (rollout.Sample.routed_experts), the router
    weights recomputed from the trainer's logits over those experts, instead of the trainer's own top-k.
    Removes the expert-choice part of the rollout/trainer mismatch (moe/routing_mismatch, logged every
    step either way). Needs a MoE model."""


@dataclass
class OptimConfig:
    name: Literal["adamw", "adamw8bit", "adamw8bit_rms"] = "adamw"
    """adamw: torch.optim.AdamW (states in the parameter dtype: 8 bytes per fp32 parameter).
    adamw8bit_rms: torchao's AdamW8bit storing sqrt(v) instead of v (optimizer.py), states quantized
    block-wise to 8 bits (2 bytes per parameter): fp32 master weights of an 8B model next to vLLM on
    one 141 GB GPU, updates within Adam's bound. adamw8bit: torchao.optim.AdamW8bit as is; its v decodes
    to 0 for entries small next to their block's largest, and their updates reach thousands of x lr
    (docs/results.md#the-8b-configs-under-adamw8bit_rms-2026-11-26-nvidia-h200-141-gb)."""
    update_ratio_warn: float = 2.0
    """Warn when optim/update_ratio_max (the largest |dw| / lr of the step's fp32 weights; Adam's
    bound is ~1) exceeds this."""
    update_ratio_stop: float = 50.0
    """Abort when optim/update_ratio_max exceeds this (0 = never)."""
    bf16_stochastic_round: bool = False
    """With model.dtype=bfloat16 and an 8-bit optim.name: round each updated weight to bf16
    stochastically (unbiased), so updates below half a bf16 ulp survive on average (torchao)."""
    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    warmup_steps: int = 0
    """Linear warm-up in optimizer steps, then constant."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this (> 0); null = no clipping (the norm is still logged,
    as optim/grad_norm; optim/grad_norm_clipped is the norm after clipping)."""


@dataclass
class TrainConfig:
    steps: int = 100
    """Rollout steps (each: generate, score, one or more optimizer steps, sync)."""
    mini_batch_size: int = 0
    """Samples per optimizer step; 0 = all samples of the step (one optimizer step)."""
    micro_batch_size: int = 16
    """Samples per forward/backward (gradient accumulation up to mini_batch_size)."""
    pack_micro_batches: bool = False
    """Micro-batches cut by tokens instead of rows: rows of like length packed while rows x padded length
    stays within micro_batch_size x the longest row (rollout.max_model_len, else data.max_prompt_tokens +
    rollout.max_new_tokens), in both trainer passes (batch.by_length): ~2x fewer micro-batches at
    reasoning-RL lengths (mean ~1,600 of 4,096 tokens), so fewer FSDP2 collectives per step. On one GPU
    at 8B it did not speed up the FP8 trainer and raised peak memory (the token bound is the same), so
    the configs leave it off
    (docs/results.md#packed-micro-batches-the-llama-pair-at-16-prompts-2026-11-27-2-x-nvidia-h200-141-gb-one-host)."""
    old_logp: Literal["trainer", "rollout"] = "trainer"
    """Where the PPO ratio's behaviour logprobs (old_logp) come from. trainer: the trainer's forward of the
    weights that sampled (textbook PPO; the IS correction then weighs the engine/trainer mismatch): a
    no-grad pass over every mini-batch but the first, whose own training forward runs on those weights
    before any optimizer step and gives its rows' (their ratio is exactly 1; with train.mini_batch_size=0
    the no-grad pass is gone). mismatch/*, policy/entropy and the q/k/v amax (fp8.calib_pass=logprobs)
    are measured over every row once that forward has run. It already needs the entropy bonus's
    coefficient, so loss.entropy_target's controller steps on the previous step's policy/entropy (on a
    run's first step, with no measurement yet, the adaptive bonus is off).
    rollout: the engine's own logprobs, and the no-grad pass is skipped: the "bypass" form of decoupled
    PPO (verl), where the clipped ratio exp(logp - rollout_logp) takes the mismatch in and the IS weight
    is 1; the measurements above are then over the first mini-batch's rows. It saves the rest of the
    logprobs pass but learns slower where the mismatch is large: the PPO clip
    then acts on the mismatch (8% of the tokens clipped with FP8 KV on a real model, sampled reward 0.32
    against 0.36 at the end: docs/results.md, "The bypass against the trainer's old_logp"), so it is not
    the default."""
    fused_head: bool = False
    """The policy forward's LM head and log-softmax fused (batch._HeadLogprobs): no [tokens, vocab]
    tensor is kept for backward (7 bytes per token and vocabulary entry: ~14 GiB at 4 x 4128 tokens and
    Llama's 128k vocabulary), but backward recomputes the logits, so the train pass is slower
    (docs/results.md#the-fused-lm-head-memory-for-time-2026-11-26-2-x-nvidia-h200). For cards where the
    micro-batch does not fit otherwise. The no-grad passes always run it fused: there it is faster."""
    device: str = "auto"
    seed: int = 0
    val_every: int = 10
    """Validation (greedy accuracy on the held-out split) every N steps; 0 = off."""
    val_max_prompts: int = 200
    probe: bool = False
    """Check the update direction on any model (random weights included): rewards become 1 for samples
    whose first response token id is even, and no-grad forwards over the step's batch before and after
    its updates log probe/policy_gain (> 0: the policy moved toward the rewarded samples; probe.py).
    Both forwards run the master weights without FP8 quantization: at RL learning rates an update
    moves the FP8 weights by rounding flips whose noise hides its direction."""
    ckpt_every: int = 0
    """Checkpoint every N steps (and at the end); 0 = only at the end."""
    save_final: bool = True
    """Checkpoint after the last step (benchmarks turn it off: an 8B state is ~50 GB)."""
    keep_ckpts: int = 2
    """Checkpoints kept (the newest); 0 = all."""
    out_dir: str = "runs"
    run_name: str = ""
    """'' = <config name>-<timestamp>."""
    mismatch_warn: float = 1.5
    """Warn loudly when mismatch/token_mult_prob_error exceeds this."""
    mismatch_stop: float = 0.0
    """Abort when token_mult_prob_error exceeds this (0 = never)."""
    max_bad_steps: int = 5
    """Abort after this many consecutive steps skipped for non-finite loss/grads."""
    dynamic_sampling: Literal["none", "filter", "resample"] = "none"
    """DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476): groups whose n rewards are all
    equal carry no gradient; as the policy collapses they fill the batch and shrink the step to 0.
    filter: leave them out of the loss (its token mean runs over the other groups' tokens only).
    resample: as filter, and roll out more prompts (up to max_rollout_rounds rounds per step) until
    the batch holds rollout.prompts_per_step groups with variance. none: train on every group.
    losses/collapse.py has the details."""
    max_rollout_rounds: int = 3
    """dynamic_sampling=resample: most rollout rounds per step (each a fresh prompts_per_step
    prompts); if the batch is still short after them, zero-variance groups fill it, masked out."""
    compile: Literal["none", "auto", "inductor", "aot_eager"] = "none"
    """torch.compile each decoder layer of the trainer (as torchtitan does; the layers share one
    graph): 'inductor' fuses norms, RoPE, SiLU*mul, residual adds and the glue around the FP8
    GEMMs into few Triton kernels and cuts launch overhead (GPU; on CPU it needs a C compiler and
    buys little); 'aot_eager' traces without code generation, to debug compile problems. The
    first step pays the compilation, and the second distinct sequence length one more (a
    dynamic-shape graph); q/k/v calibration records inside the compiled layers (a second graph
    variant: recording on). With the unfused head (fused_head false), the train forward's log-softmax over
    the [rows, length, vocab] logits is compiled too, one graph for every micro-batch shape. Off: eager
    PyTorch. 'auto': inductor on a GPU, eager on CPU (the 8B configs: one file for their GPU runs and
    their CPU test)."""


@dataclass
class LogConfig:
    tensorboard: bool = True
    dump_episodes_every: int = 10
    """Write sampled episodes to <run_dir>/episodes/step_N.jsonl every N steps (0 = off)."""
    dump_episodes_n: int = 16
    save_batch_every: int = 0
    """Save the full rollout batch (token ids, mask, engine / trainer (as used) / trainer-BF16
    logprobs, rewards, advantages, config) to <run_dir>/batches/step_N.pt every N steps, for
    notebooks/ (observe.load_rollout_batch); costs one extra no-grad BF16 forward. 0 = off."""
    profile_step: int = -1
    """Run this step under torch.profiler (CPU + CUDA, in-process vLLM included): writes
    <run_dir>/profile/step_N_rankR.json (trace for Perfetto / chrome://tracing) and .txt (each
    phase's wall time and device-busy share, the top device kernels, then the top operators by self
    device time, CPU time on CPU; observe.save_profile). -1 = off; step 0 includes autotuning."""
    profile_rollout: bool = True
    """false: profile_step's profile starts after the rollout (the trainer's logprobs, train,
    recalibrate and refit only): a long-generation rollout is ~1e6 kernels, a trace too big to read."""
    profile_trace: bool = True
    """false: profile_step writes the .txt's phase and kernel tables only (seconds), without the operator
    table and the .json trace, which take minutes at a long step's ~1e6 events."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    fp8: FP8Config = field(default_factory=FP8Config)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)

    @property
    def micro_batch_tokens(self) -> int:
        """The worst-case micro-batch's tokens: train.micro_batch_size rows of the longest row (rollout.
        max_model_len, else data.max_prompt_tokens + rollout.max_new_tokens); train.pack_micro_batches
        packs up to it."""
        r = self.rollout
        return self.train.micro_batch_size * (r.max_model_len or self.data.max_prompt_tokens + r.max_new_tokens)


def _read_yaml(path: Path, seen: tuple = ()) -> dict:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if path.resolve() in seen:
        raise ConfigError(f"config {path}: circular 'base:' chain")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config {path}: invalid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config {path}: top level must be a mapping of sections")
    base = raw.pop("base", None)
    if base is None:
        return raw
    merged = _read_yaml(path.parent / base, seen + (path.resolve(),))
    _deep_merge(merged, raw)
    return merged


def _deep_merge(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _deep_merge(dst[k], v)
        else:
            dst[k] = v


def _check_type(key: str, value, tp):
    """Return `value` converted to annotation `tp`, or raise ConfigError naming `key`."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{key}: {value!r} is not one of {list(typing.get_args(tp))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _check_type(key, value, a)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_check_type(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads '1e-4' (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp in _EXPECTED and (not isinstance(value, tp) or (tp is int and isinstance(value, bool))):
        got = repr(value) if isinstance(value, str) else f"{type(value).__name__} {value!r}"
        raise ConfigError(f"{key}: expected {_EXPECTED[tp]}, got {got}")
    return value


_EXPECTED = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _build(cls, data: dict, prefix: str = ""):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for k, v in data.items():
        if k not in fields:
            raise ConfigError(f"unknown config key '{prefix}{k}' (valid keys in this section: "
                              f"{', '.join(fields)})")
        tp = hints[k]
        if dataclasses.is_dataclass(tp):
            kwargs[k] = _build(tp, v, f"{prefix}{k}.")
        else:
            kwargs[k] = _check_type(prefix + k, v, tp)
    for k, f in fields.items():  # nested sections not given still need the prefix for errors
        if k not in kwargs and dataclasses.is_dataclass(hints[k]):
            kwargs[k] = _build(hints[k], {}, f"{prefix}{k}.")
    try:
        return cls(**kwargs)
    except ValueError as e:  # __post_init__ validation (e.g. LossConfig enums)
        raise ConfigError(f"{prefix.rstrip('.')}: {e}") from None


def field_type(keys: list[str]):
    """The declared type of the field at `keys` (e.g. ['optim', 'lr'] -> float); None if there is none."""
    tp = Config
    for k in keys:
        if not dataclasses.is_dataclass(tp):
            return None
        tp = typing.get_type_hints(tp).get(k)
    return tp


def parse_override(text: str) -> tuple[list[str], object]:
    """'section.key=value' -> (['section', 'key'], value). The value is read as YAML, but a str field
    takes the raw text: YAML would read '#### (.*)' as a comment (None), '123' as an int, 'a: b' as a map."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    keys = key.strip().split(".")
    quoted = len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\""  # a quoted str: YAML unquotes it
    if (field_type(keys) is str and not quoted) or raw == "":
        return keys, raw
    try:
        return keys, yaml.safe_load(raw)
    except yaml.YAMLError:
        return keys, raw


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Config from a YAML file (with `base:` inheritance) plus `key.sub=value` overrides."""
    data = _read_yaml(Path(path)) if path else {}
    cli_values = {}
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: '{k}' is not a section")
        node[keys[-1]] = value
        cli_values[".".join(keys)] = value
    try:
        cfg = _build(Config, data)
    except ConfigError as e:  # an override of the wrong type: say how YAML read it where that is the cause
        key = next((k for k in cli_values if str(e).startswith((k + ":", k + "["))), None)
        if key is not None and "expected a string" in str(e):  # a str item of a list, read as a number
            example = "['...']" if isinstance(cli_values[key], list) else "'...'"
            raise ConfigError(f"{e} (override values are read as YAML: quote a string, e.g. {key}=\"{example}\")") \
                from None
        if key is not None and str(e).startswith(key + ": expected") and isinstance(cli_values[key], (dict, list)):
            raise ConfigError(f"{e} (override values are read as YAML)") from None  # e.g. `8: 4`, a mapping
        raise
    validate(cfg)
    return cfg


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def validate(cfg: Config) -> None:
    """Reject settings that would crash late, or stop or reverse learning without a word (a negative lr
    ascends the loss; is_cap=0 or max_grad_norm=0 zero every update). One row per rule:
    (key, value, ok, what it must be). LossConfig checks its names, clip and 0 <= is_floor <= is_cap itself."""
    m, d, r, f, lo, o, t, lg = cfg.model, cfg.data, cfg.rollout, cfg.fp8, cfg.loss, cfg.optim, cfg.train, cfg.log
    a = cfg.advantage
    samples = r.n * r.prompts_per_step
    on_policy_weight = _on_policy_weight(lo)
    window = (f"with loss.is_correction={lo.is_correction}: a token engine and trainer agree on has weight 1 (nearly "
              "every other one is near it), so a window [loss.is_floor, loss.is_cap] without 1 takes every token out "
              "of the gradient")
    mb = t.mini_batch_size or samples
    rules = [
        ("model.gradient_checkpointing_every", m.gradient_checkpointing_every, m.gradient_checkpointing_every >= 1,
         ">= 1 (1 checkpoints every layer; model.gradient_checkpointing=false none)"),
        ("model.tiny.arch", m.tiny.arch, m.tiny.arch in FAMILIES,
         f"one of {', '.join(map(repr, FAMILIES))} (a family file in models/)"),
        ("model.tiny.hidden_size", m.tiny.hidden_size, m.tiny.hidden_size >= 1, ">= 1"),
        ("model.tiny.intermediate_size", m.tiny.intermediate_size, m.tiny.intermediate_size >= 1, ">= 1"),
        ("model.tiny.num_layers", m.tiny.num_layers, m.tiny.num_layers >= 1, ">= 1"),
        ("model.tiny.head_dim", m.tiny.head_dim, m.tiny.head_dim >= 1, ">= 1"),
        ("model.tiny.num_kv_heads", m.tiny.num_kv_heads,
         m.tiny.num_kv_heads >= 1 and m.tiny.num_heads % m.tiny.num_kv_heads == 0,
         f">= 1 and divide model.tiny.num_heads ({m.tiny.num_heads})"),
        ("model.tiny.vocab", m.tiny.vocab, len(m.tiny.vocab) > 0, "a non-empty string of characters"),
        *_tiny_moe_rules(m.tiny),
        ("data.val_size", d.val_size, d.val_size >= 0, ">= 0"),
        ("data.max_prompt_tokens", d.max_prompt_tokens, d.max_prompt_tokens >= 1, ">= 1"),
        ("data.synthetic.difficulty", d.synthetic.difficulty, 1 <= d.synthetic.difficulty <= 5, "1 to 5"),
        ("data.synthetic.num_train", d.synthetic.num_train, d.synthetic.num_train >= 1, ">= 1"),
        ("data.path", d.path, d.source == "synthetic" or d.path,
         f"set for data.source={d.source} (a JSONL file or an HF datasets id)"),
        ("data.reward", d.reward, d.reward in REWARDS, f"one of {', '.join(map(repr, REWARDS))} (rewards.REWARDS)"),
        ("advantage.estimator", a.estimator, a.estimator in ADVANTAGE_REGISTRY,
         f"one of {ADVANTAGE_REGISTRY.choices()} (losses.advantages.ADVANTAGE_REGISTRY)"),
        ("advantage.eps", a.eps, a.eps > 0, "> 0 (a group whose rewards are all equal has std 0)"),
        ("rollout.prompts_per_step", r.prompts_per_step, r.prompts_per_step >= 1, ">= 1"),
        ("rollout.n", r.n, r.n >= 2, ">= 2: group-normalised advantages need 2+ samples per prompt "
         "(with 1 every advantage is 0 and nothing is learned)"),
        ("rollout.max_new_tokens", r.max_new_tokens, r.max_new_tokens >= 1, ">= 1"),
        ("rollout.ignore_eos_median", r.ignore_eos_median, r.ignore_eos_median == 0 or (
            r.ignore_eos and r.engine == "vllm" and r.ignore_eos_median >= 1),
         "0, or >= 1 with rollout.ignore_eos=true and rollout.engine=vllm (a benchmark's length draw)"),
        ("rollout.ignore_eos_sigma", r.ignore_eos_sigma, r.ignore_eos_sigma > 0, "> 0"),
        ("rollout.temperature", r.temperature, r.temperature > 0, "> 0 (training samples; validation is greedy anyway)"),
        ("rollout.top_p", r.top_p, 0 < r.top_p <= 1, "in (0, 1]"),
        ("rollout.gpu_memory_utilization", r.gpu_memory_utilization, 0 < r.gpu_memory_utilization <= 1, "in (0, 1]"),
        ("rollout.max_model_len", r.max_model_len, r.max_model_len >= 0, ">= 0 (0 = prompt + max_new_tokens)"),
        ("rollout.block_size", r.block_size, r.block_size >= 0 and r.block_size % 16 == 0,
         "0 (vLLM's default) or a multiple of 16"),
        ("rollout.max_num_seqs", r.max_num_seqs, r.max_num_seqs >= 0, ">= 0 (0 = vLLM's default)"),
        ("rollout.kv_cache_gib", r.kv_cache_gib, r.kv_cache_gib >= 0, ">= 0 (0 = sized by gpu_memory_utilization)"),
        ("rollout.tensor_parallel_size", r.tensor_parallel_size, r.tensor_parallel_size >= 1, ">= 1"),
        ("rollout.engine_ranks", r.engine_ranks, r.engine_ranks >= 1, ">= 1"),
        ("rollout.max_staleness", r.max_staleness, r.max_staleness in (0, 1),
         "0 or 1 (one batch is in flight at a time: engines/remote.py)"),
        ("rollout.tensor_parallel_size", r.tensor_parallel_size, r.mode == "colocated" or r.tensor_parallel_size == 1,
         "1 with rollout.mode=async (each engine rank runs a whole engine)"),
        ("train.dynamic_sampling", t.dynamic_sampling, r.mode == "colocated" or t.dynamic_sampling != "resample",
         "none or filter with rollout.mode=async (resample rounds wait on the reward of the batch in flight)"),
        ("fp8.calib_percentile", f.calib_percentile, 0 < f.calib_percentile <= 100, "in (0, 100]"),
        ("fp8.calib_margin", f.calib_margin, f.calib_margin > 0, "> 0"),
        ("fp8.calib_samples", f.calib_samples, f.calib_samples >= 1, ">= 1"),
        ("fp8.keep_first_layers", f.keep_first_layers, f.keep_first_layers >= 0, ">= 0"),
        ("fp8.keep_last_layers", f.keep_last_layers, f.keep_last_layers >= 0, ">= 0"),
        ("loss.is_cap", lo.is_cap, lo.is_cap > 0 or lo.is_correction == "none",
         "> 0 (0 zeroes every importance weight, so every update; loss.is_correction=none turns IS off)"),
        # A token engine and trainer agree on has weight 1, and the mismatch keeps nearly every other one near
        # 1. icepop and seq_mask_tis zero a weight outside [is_floor, is_cap]: a window without 1 zeroes them
        # all and nothing is learned. tis and seq_tis only cap (a cap < 1 scales every weight down, as a
        # smaller lr would; the floor is unused) and none uses neither, so those are left alone. Rather than
        # list the masking variants, validate asks the configured one what it gives such a token.
        ("loss.is_floor", lo.is_floor, lo.is_floor <= 1 or on_policy_weight > 0, f"<= 1 {window}"),
        ("loss.is_cap", lo.is_cap, lo.is_cap >= 1 or on_policy_weight > 0, f">= 1 {window}"),
        ("loss.kl_coef", lo.kl_coef, lo.kl_coef >= 0, ">= 0"),
        ("loss.entropy_coef", lo.entropy_coef, lo.entropy_coef >= 0, ">= 0 (a negative bonus drives entropy down)"),
        ("loss.entropy_target", lo.entropy_target, lo.entropy_target is None or lo.entropy_target > 0,
         "> 0 nats, or null (a fixed loss.entropy_coef)"),
        ("loss.entropy_coef_step", lo.entropy_coef_step, lo.entropy_coef_step > 0, "> 0"),
        ("moe.aux_loss_coef", cfg.moe.aux_loss_coef, cfg.moe.aux_loss_coef >= 0, ">= 0 (0 = off)"),
        ("optim.lr", o.lr, o.lr > 0, "> 0 (0 never moves the weights; a negative lr ascends the loss)"),
        ("optim.betas", o.betas, len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
         "two numbers in [0, 1), e.g. [0.9, 0.999]"),
        ("optim.eps", o.eps, o.eps > 0, "> 0"),
        ("optim.weight_decay", o.weight_decay, o.weight_decay >= 0, ">= 0"),
        ("optim.warmup_steps", o.warmup_steps, o.warmup_steps >= 0, ">= 0 (a negative warm-up gives a negative lr)"),
        ("optim.max_grad_norm", o.max_grad_norm, o.max_grad_norm is None or o.max_grad_norm > 0,
         "> 0, or null for no clipping (0 would zero every update)"),
        ("optim.update_ratio_warn", o.update_ratio_warn, o.update_ratio_warn > 0, "> 0"),
        ("optim.update_ratio_stop", o.update_ratio_stop, o.update_ratio_stop >= 0, ">= 0 (0 = never stop)"),
        ("train.steps", t.steps, t.steps >= 1, ">= 1"),
        ("train.max_rollout_rounds", t.max_rollout_rounds, t.max_rollout_rounds >= 1, ">= 1"),
        ("train.micro_batch_size", t.micro_batch_size, t.micro_batch_size >= 1, ">= 1"),
        ("train.mini_batch_size", t.mini_batch_size,
         mb >= 1 and t.micro_batch_size >= 1 and samples % mb == 0 and mb % min(t.micro_batch_size, mb) == 0,
         f"0 (all samples) or divide rollout.n * rollout.prompts_per_step ({samples}) and be a multiple of "
         f"train.micro_batch_size ({t.micro_batch_size})"),
        ("train.device", t.device, re.fullmatch(r"auto|cpu|cuda(:\d+)?", t.device), "auto, cpu, cuda or cuda:N"),
        ("train.val_every", t.val_every, t.val_every >= 0, ">= 0 (0 = no validation)"),
        ("train.val_max_prompts", t.val_max_prompts, t.val_max_prompts >= 1 or t.val_every == 0,
         ">= 1 while train.val_every > 0 (or set train.val_every=0)"),
        ("train.ckpt_every", t.ckpt_every, t.ckpt_every >= 0, ">= 0 (0 = only at the end)"),
        ("train.keep_ckpts", t.keep_ckpts, t.keep_ckpts >= 0, ">= 0 (0 = keep all)"),
        ("train.run_name", t.run_name, "/" not in t.run_name and t.run_name not in (".", ".."),
         "a plain directory name (no '/'); train.out_dir sets where it goes"),
        ("train.mismatch_stop", t.mismatch_stop, t.mismatch_stop >= 0, ">= 0 (0 = never stop)"),
        ("train.max_bad_steps", t.max_bad_steps, t.max_bad_steps >= 1, ">= 1"),
        ("log.dump_episodes_every", lg.dump_episodes_every, lg.dump_episodes_every >= 0, ">= 0 (0 = off)"),
        ("log.save_batch_every", lg.save_batch_every, lg.save_batch_every >= 0, ">= 0 (0 = off)"),
        ("log.profile_step", lg.profile_step, lg.profile_step >= -1, ">= 0, or -1 (off)"),
    ]
    for key, value, _, _ in rules:  # NaN passes no comparison, but say what is wrong with it
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, float) and math.isnan(v) for v in values):
            raise ConfigError(f"{key}={value}: must be a number, not NaN")
    for key, value, ok, need in rules:
        if not ok:
            raise ConfigError(f"{key}={value!r}: must be {need}")
    for key, value in [("optim.lr", o.lr), ("optim.eps", o.eps), ("optim.max_grad_norm", o.max_grad_norm or 0),
                       ("loss.clip_low", lo.clip_low), ("loss.clip_high", lo.clip_high), ("loss.kl_coef", lo.kl_coef),
                       ("rollout.temperature", r.temperature), ("data.format_reward", d.format_reward),
                       ("advantage.eps", a.eps), ("moe.aux_loss_coef", cfg.moe.aux_loss_coef)]:
        if not _finite(value):
            raise ConfigError(f"{key}={value}: must be a finite number")
    _check_updates_survive(cfg)


def _on_policy_weight(lo: LossConfig) -> float:
    """The weight lo.is_correction gives a token whose engine and trainer logprobs agree (raw weight 1)."""
    zero = torch.zeros(1, 1)  # [B=1, T=1] logprobs
    w, _, _ = is_weights(zero, zero, torch.ones(1, 1), lo)
    return float(w)


def _tiny_moe_rules(t: TinyModelConfig) -> list:
    """validate's rows for the tiny model's expert counts: set for a MoE family, 0 for a dense one."""
    spec = FAMILIES.get(t.arch)
    if spec is None or spec.experts is None:
        return [("model.tiny.num_experts", t.num_experts, t.num_experts == 0,
                 f"0 for the dense family {t.arch!r} (experts need a MoE family, e.g. model.tiny.arch=qwen3_moe)")]
    return [("model.tiny.num_experts", t.num_experts, t.num_experts >= 2, f">= 2 for the MoE family {t.arch!r}"),
            ("model.tiny.num_experts_per_tok", t.num_experts_per_tok, 1 <= t.num_experts_per_tok <= t.num_experts,
             f"in [1, model.tiny.num_experts] ({t.num_experts})"),
            ("model.tiny.moe_intermediate_size", t.moe_intermediate_size, t.moe_intermediate_size >= 1, ">= 1")]


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """{field: its attribute docstring} of a config dataclass (fields without one are left out)."""
    import ast
    import inspect

    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {node.target.id: inspect.cleandoc(doc.value.value) for node, doc in zip(body, body[1:])
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
            and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)}


def describe(cfg) -> str:
    """The config as YAML, each field's doc as a comment above it (train_grpo.py --print-config): a file
    that load_config reads back to the same config."""
    lines = []

    def walk(section, indent: str) -> None:
        docs = field_docs(type(section))
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            lines.extend(f"{indent}# {line}".rstrip() for line in docs.get(f.name, "").splitlines())
            if dataclasses.is_dataclass(value):
                lines.append(f"{indent}{f.name}:")
                walk(value, indent + "  ")
            else:
                text = yaml.safe_dump(value, default_flow_style=True, width=math.inf).rstrip("\n")
                lines.append(f"{indent}{f.name}: {text.removesuffix(chr(10) + '...')}")  # one line: a scalar, [...]

    walk(cfg, "")
    return "\n".join(lines) + "\n"


BF16_MIN_LR = 1e-4
"""The smallest lr whose round-to-nearest Adam steps (~lr per weight) move >= 99% of bf16 weights of
std 0.02: half a bf16 ulp is 2^-13 ~ 1.2e-4 for 0.031 <= |w| < 0.0625 (|w| < 2.6 sigma: 99%)."""


def _check_updates_survive(cfg: Config) -> None:
    """Refuse settings whose optimizer steps round away (optimizer.py explains the arithmetic)."""
    o, dtype = cfg.optim, cfg.model.dtype
    if o.bf16_stochastic_round and (o.name == "adamw" or dtype != "bfloat16"):
        raise ConfigError("optim.bf16_stochastic_round applies to bf16 weights under torchao's optimizer: set "
                          "model.dtype=bfloat16 and optim.name=adamw8bit_rms, or optim.bf16_stochastic_round=false")
    if dtype == "bfloat16" and not o.bf16_stochastic_round and o.lr < BF16_MIN_LR:
        raise ConfigError(
            f"model.dtype=bfloat16 with optim.lr={o.lr:g}: bf16 weights round updates below ~{BF16_MIN_LR:g} away (half "
            "an ulp at |w| ~ 0.03), so they barely move; set model.dtype=float32 (fp32 master weights; "
            "optim.name=adamw8bit_rms to fit one GPU), or optim.name=adamw8bit_rms optim.bf16_stochastic_round=true")
