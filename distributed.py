"""Multi-GPU under torchrun: process group, FSDP2 sharding, and the few reductions the loop needs.

    torchrun --nproc_per_node 8 train_grpo.py --config configs/llama31_8b_fp8.yaml
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HEAD:29500 \
        train_grpo.py --config configs/llama31_8b_fp8.yaml

Layout: data parallel over prompts. Every rank draws the same global batch of prompts from the
same sampler and takes its contiguous slice (whole GRPO groups, never split), generates it with
its own engine (vLLM external_launcher, one TP=1 engine per rank; HF on CPU), scores it, and
trains on it. With rollout.tensor_parallel_size=k, k consecutive ranks share one vLLM engine
(tensor parallel; vLLM's "external DP" x TP layout): they generate the union of their slices
together, identically, and each keeps its own slice (`rollout_share`).

The trainer is FSDP2: `fully_shard` per decoder layer, then the root; parameters keep their
dtype (fp32 master or bf16), compute runs in bf16 where the run asks for it, and gradients are
reduce-scattered in fp32. FP8 linears (torchao or emulated) are converted before sharding, so
they see the all-gathered weight exactly like on one GPU; with fp8.cache_weights the all-gather moves
each rank's shard as FP8 bytes and block scales instead (fp8/fast/gather.py; checkpoints stay plain).
Refit streams the export one parameter at a time (`fp8/export.py` gathers each DTensor with
`full_tensor()`): no full-model copy on any rank. Checkpoints are sharded the same way: each rank
writes and reads its own shards (checkpoint.py, torch.distributed.checkpoint), which DCP reshards for
another world size.

Loss scaling: a micro-batch's loss is weighted by its share of the GLOBAL mini-batch (tokens or
rows), and FSDP2's gradient averaging over ranks is undone by `grad_scale` = world size, so the
summed gradient equals the one-GPU gradient of the same global batch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

import models
from config import Config
from errors import UserError


@dataclass
class Dist:
    rank: int = 0
    world: int = 1  # trainer ranks (rollout.mode=async: the engine ranks not counted)
    device: torch.device = torch.device("cpu")
    tp: int = 1  # rollout.tensor_parallel_size: ranks per engine (consecutive ranks)
    engine: int = -1  # rollout.mode=async: this rank's engine index (-1: a trainer rank)
    engines: int = 0  # rollout.mode=async: engine ranks (global ranks world ... world + engines - 1)
    link: object = None  # rollout.mode=async: gloo over every rank, trainer <-> engine (engines/remote.py)
    weights: object = None  # rollout.mode=async, trainer rank 0 and the engines: the weights' bytes (NCCL on GPUs)

    @property
    def main(self) -> bool:
        return self.rank == 0


def rollout_share(d: Dist, prompts_per_step: int) -> tuple[slice, slice]:
    """(gen, own): the slice of the step's prompts this rank's engine generates, and within those
    the prompts this rank trains on. Each rank trains on its contiguous 1/world of the prompts (whole
    groups); a tensor-parallel engine group of d.tp ranks generates the union of its ranks' shares
    (every rank of the group must call generate with the same prompts and seed)."""
    local = prompts_per_step // d.world
    start = d.rank // d.tp * d.tp * local
    own = d.rank % d.tp * local
    return slice(start, start + d.tp * local), slice(own, own + local)


def init(cfg: Config) -> Dist:
    """The device of this process; joins the process group when launched by torchrun with > 1 rank.
    rollout.mode=async: the default process group holds the trainer ranks only (FSDP2, checkpoints and
    the loop's reductions never see an engine rank), and `link` joins every rank (engines/remote.py)."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if cfg.rollout.mode == "async":
        return _init_async(cfg, world, rank)
    device = _device(cfg)
    tp = cfg.rollout.tensor_parallel_size
    if tp < 1 or world % tp:
        raise UserError(f"rollout.tensor_parallel_size={tp} must be >= 1 and divide the {world} rank(s); launch "
                        f"with torchrun --nproc_per_node a multiple of {max(tp, 1)}, or set it to 1")
    if world > 1:
        _check_batch_divides(cfg, world, f"{world} ranks")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device
                                    if device.type == "cuda" else None)
    return Dist(rank, world, device, tp)


def _check_batch_divides(cfg: Config, n: int, ranks: str) -> None:
    """The step's prompts and the mini-batch split over n training ranks (`ranks`: the error's name for them)."""
    if cfg.rollout.prompts_per_step % n:
        raise UserError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} is not divisible by the {ranks}: "
                        f"each rank generates whole groups; use a multiple of {n}")
    if cfg.train.mini_batch_size % n:
        raise UserError(f"train.mini_batch_size={cfg.train.mini_batch_size} is not divisible by the {ranks}; use a "
                        f"multiple of {n} (0 = the whole step's samples)")


def _device(cfg: Config) -> torch.device:
    name = cfg.train.device
    if name == "auto":
        name = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"train.device={name} but CUDA is not available; set train.device=cpu")
    return torch.device(name)


def _init_async(cfg: Config, world: int, rank: int) -> Dist:
    """rollout.mode=async: ranks 0 .. W-1 train (their own default process group), the last
    rollout.engine_ranks generate; a gloo group over all of them carries batches and messages, and a
    group of trainer rank 0 and the engines (NCCL between GPUs, else gloo) the weights' bytes."""
    from datetime import timedelta

    k = cfg.rollout.engine_ranks
    trainers = world - k
    if trainers < 1:
        raise UserError(f"rollout.mode=async with rollout.engine_ranks={k} needs more than {k} ranks (torchrun "
                        f"--nproc_per_node {k + 1} or more: the engines plus at least one trainer); {world} launched")
    if k > trainers:
        raise UserError(f"rollout.engine_ranks={k} with {trainers} trainer rank(s) ({world} launched): an engine "
                        f"serves whole trainer ranks, so at most {trainers}; launch more ranks or use fewer engines")
    _check_batch_divides(cfg, trainers, f"{trainers} trainer rank(s) ({world} ranks, {k} of them engines)")
    device = _device(cfg)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = next(dist.rendezvous("env://"))[0]  # torchrun's store: every rank reaches it
    if rank < trainers and trainers > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.PrefixStore("trainer/", store),
                                rank=rank, world_size=trainers, device_id=device if device.type == "cuda" else None)
    # no timeout short of a whole step: a trainer waits on the engines' batch for as long as they generate
    link = dist.ProcessGroupGloo(dist.PrefixStore("link/", store), rank, world, timedelta(hours=6))
    weights, members = None, [0, *range(trainers, world)]  # trainer rank 0 broadcasts each version to the engines
    if rank in members:
        group = (dist.ProcessGroupNCCL if device.type == "cuda" else dist.ProcessGroupGloo)
        weights = group(dist.PrefixStore("weights/", store), members.index(rank), len(members), timedelta(hours=6))
    return Dist(rank, trainers, device, engine=rank - trainers if rank >= trainers else -1, engines=k, link=link,
                weights=weights)


def required_decoder_layers(model: nn.Module) -> list[nn.Module]:
    """models.decoder_layers of an HF causal LM (model.model.layers), or a UserError: compile and FSDP2
    wrap each of them, a model without them cannot be run."""
    layers = models.decoder_layers(model)
    if not layers:
        path = models.family_of(model).layers
        raise UserError(f"{type(model).__name__}: no {path} to shard; FSDP2 sharding expects an HF "
                        "decoder-only causal LM (a family in models/ names its decoder layers)")
    return layers


RECOMPILE_LIMIT = 64
COMPILED_ALIGN = 8  # the trainer's batch lengths are a multiple of this when Inductor compiles the layers
# Inductor's mix-order reduction (a norm backward's row and column sums in one kernel) decides by size
# (rows x width >= 5 Mi elements, rows >= 2 x width, rows >= 4,096), so a dynamic-length graph guards on
# those: a micro-batch length in a range not met before compiles the layer again. Off: no such guards.
INDUCTOR_OPTIONS = {"triton.mix_order_reduction": False}


def compile_layers(model: nn.Module, backend: str) -> None:
    """torch.compile each decoder layer's forward in place. Module names (so checkpoints and the
    export) are unchanged, module hooks (FSDP2's, calibration's) run outside the compiled code,
    and the layers share one graph (with use_cache=False: no per-layer cache state to guard on)."""
    # Each layer's graph has a few variants: grad mode (logprobs vs train), whether its input needs
    # grad, static vs dynamic length, an FP8 row count that is or is not a multiple of 128, masks
    # present or None. Over FSDP2 these exceed dynamo's default 8, and a call past the limit runs
    # eager: a checkpointed layer whose forward ran compiled then recomputes eagerly in backward,
    # and torch.utils.checkpoint stops the step (CheckpointError: different saved tensors).
    # dynamic=True (no static first variant) makes dynamo fail tracing the FP8 linears on CUDA
    # (docs/log.md); dynamo's automatic dynamic shapes mark only batch and length.
    # A variant first met after step 0 costs seconds of compiling, and over FSDP2 every other rank
    # waits for it: so no variants by length. Inductor guards on length % 8 (alignment; assemble_batch
    # pads to COMPILED_ALIGN) and on length ranges (INDUCTOR_OPTIONS).
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    options = {"options": INDUCTOR_OPTIONS} if backend == "inductor" else {}
    for layer in required_decoder_layers(model):
        layer.forward = torch.compile(layer.forward, backend=backend, **options)


def compiled_graphs(d: Dist) -> int:
    """Graphs dynamo has compiled so far (the layers' variants, the optimizer's update), summed over the
    ranks (collective): logged per step as compile/graphs, so a step that grew it spent time compiling,
    and over FSDP2 the other ranks waited for it."""
    from torch._dynamo.utils import counters

    return int(all_sum(torch.tensor(int(counters["stats"]["unique_graphs"]), device=d.device), d))


def graph_breaks() -> int:
    """Graph breaks dynamo has met so far in this process, logged per step as compile/graph_breaks when there
    are any: a break inside a compiled layer runs the code around it eagerly between smaller graphs, with the
    GPU idle between them."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def shard(model: nn.Module, d: Dist, bf16_compute: bool) -> nn.Module:
    """FSDP2 in place: fully_shard each decoder layer, then the root (embeddings, norm, lm_head).

    bf16_compute: all-gather fp32 master weights as bf16 (what autocast would compute with);
    gradients reduce in fp32 either way. Activation checkpointing is model.gradient_checkpointing
    (HF's: parameter names stay as in the checkpoint, so export and resume are unchanged)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if d.world == 1:
        return model
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(d.device.type, (d.world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16_compute else None, reduce_dtype=torch.float32)
    for layer in required_decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def grad_scale(d: Dist) -> float:
    """Multiplier on each rank's loss: FSDP2 averages gradients over ranks; we want their sum."""
    return float(d.world)


def clip_grad_norm(params, max_norm: float) -> Tensor:
    """Global grad norm (DTensor shards included), clipped in place like clip_grad_norm_."""
    params = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


class DevicePeak:
    """The device memory in use (total - free, as nvidia-smi counts it) at its peak, sampled every
    poll_s seconds by a daemon thread (None: only when sample() is called).

    torch's allocator peak is not this figure when vLLM runs in the process: its sleep-mode pool keeps
    its tensors allocated in torch's books while their physical memory is released, so allocator
    peaks count the sleeping engine on top of the trainer (147-155 GiB on a 140 GiB H200). The
    device figure is exact, and polling catches peaks because the caching allocator keeps what it
    reserved until the engine sleeps or the cache is emptied; a spike shorter than poll_s that is
    freed and returned at once can be missed."""

    def __init__(self, device: torch.device, poll_s: float | None = 0.02):
        self.device, self.peak = device, 0
        if poll_s:
            import atexit
            import threading

            stop = threading.Event()

            def poll():
                while not stop.wait(poll_s):
                    self.sample()
            thread = threading.Thread(target=poll, daemon=True, name="device-peak")
            thread.start()
            atexit.register(lambda: (stop.set(), thread.join()))  # no CUDA call from it while the process exits

    def sample(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        self.peak = max(self.peak, total - free)
        return total - free

    def take(self) -> int:
        """The peak since the previous take (bytes); the next interval starts at the current use."""
        peak = max(self.peak, self.sample())
        self.peak = 0
        self.sample()
        return peak


_PEAKS: dict[torch.device, DevicePeak] = {}


def peak_gib(device: torch.device) -> float:
    """The device memory in use at its peak since the previous call (DevicePeak), GiB; 0 off CUDA."""
    if device.type != "cuda":
        return 0.0
    if device not in _PEAKS:
        _PEAKS[device] = DevicePeak(device)
    return _PEAKS[device].take() / 2**30


def memory_metrics(device: torch.device) -> dict[str, float]:
    """Since the previous call: mem/peak_gib, the device memory in use at its peak (DevicePeak), and
    mem/alloc_retries, the allocator's cudaMalloc retries (each one frees cached blocks and
    synchronizes: the sign of a step short of memory, e.g. next to a vLLM share sized too large).
    {} off CUDA."""
    if device.type != "cuda":
        return {}
    retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
    torch.cuda.reset_accumulated_memory_stats(device)
    return {"mem/peak_gib": peak_gib(device), "mem/alloc_retries": float(retries)}


def all_sum(x: Tensor, d: Dist, op=dist.ReduceOp.SUM) -> Tensor:
    """x reduced over the ranks (sum, or `op`: dist.ReduceOp.MAX, ...); x itself where world == 1."""
    if d.world > 1:
        x = x.clone()
        dist.all_reduce(x, op=op)
    return x


def gather_rows(x: Tensor, d: Dist, pad: float = 0.0) -> Tensor:
    """[B_local, L_local] on each rank -> [sum B, max L] on every rank, in rank order (right-padded)."""
    if d.world == 1:
        return x
    lengths = [torch.zeros((), dtype=torch.long, device=x.device) for _ in range(d.world)]
    dist.all_gather(lengths, torch.tensor(x.shape[1], device=x.device))
    width = int(max(lengths))
    x = torch.nn.functional.pad(x, (0, width - x.shape[1]), value=pad)
    parts = [torch.empty_like(x) for _ in range(d.world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Name of each optimizer parameter, in the optimizer's index order (what torch's id keys count)."""
    name = {p: n for n, p in model.named_parameters()}  # tied weights: the first name, as get_state_dict
    return [name[p] for g in optimizer.param_groups for p in g["params"]]


def _rekey(optim_sd: dict, key) -> dict:
    """optim_sd with its per-parameter keys (state and param_groups' params) mapped through key."""
    return {**optim_sd, "state": {key[k]: v for k, v in optim_sd["state"].items()},
            "param_groups": [{**g, "params": [key[k] for k in g["params"]]} for g in optim_sd["param_groups"]]}


def _by_index(optim_sd: dict) -> bool:
    """Optimizer state keyed by parameter index: optimizer.state_dict() as single-process runs wrote it
    before checkpoints were keyed by name."""
    return any(isinstance(k, int) for g in optim_sd["param_groups"] for k in g["params"])


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model, optimizer) state dicts as checkpoint.py saves them with DCP: this rank's FSDP2 shards
    (DTensors; plain tensors in one process) on their device, referencing the live tensors; the
    optimizer's keyed by parameter name (FQN). An optimizer that has not stepped gets its state
    initialised first (get_state_dict's step at lr 0: the parameters do not move), so a checkpoint's
    moments have tensors to load into."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return _plain(get_state_dict(model, optimizer, options=StateDictOptions()))


def _plain(state):
    """`state` with each tensor that wraps a plain one for FSDP2's all-gather (a `plain()` method: fp8.cache_weights
    over ranks, fp8/fast/gather.py), or a DTensor of one, replaced by the plain tensor (same storage): checkpoints
    hold plain tensors, whatever the all-gather moves."""
    import torch.utils._pytree as pytree
    from torch.distributed.tensor import DTensor

    def plain(t):
        if isinstance(t, DTensor) and hasattr(t._local_tensor, "plain"):
            return DTensor.from_local(t._local_tensor.plain(), t.device_mesh, t.placements, run_check=False,
                                      shape=t.shape, stride=t.stride())
        return t.plain() if hasattr(t, "plain") else t
    return pytree.tree_map_only(Tensor, plain, state)


def load_sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict) -> None:
    """Inverse of sharded_state, after dcp.load has filled its tensors."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=StateDictOptions())


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer, d: Dist) -> tuple[dict, dict]:
    """(model, optimizer) state dicts with full tensors (the single-file checkpoint format of earlier
    versions, and bench/checkpoint.py's baseline): the model's as model.state_dict() names it, the
    optimizer's keyed by parameter name (FQN), as torch.distributed.checkpoint's
    get_state_dict(full_state_dict=True) writes it. Collective when world > 1 (tensors offloaded to CPU)."""
    if d.world == 1:  # same keys as get_state_dict, without its zero-lr step on an empty optimizer
        return model.state_dict(), _rekey(optimizer.state_dict(), _param_names(model, optimizer))
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict,
                    d: Dist) -> None:
    """Inverse of full_state, whatever world size wrote it: every rank reads the same file and keeps
    its shard (single-file checkpoints). Also loads index-keyed optimizer state (the oldest ones)."""
    names = _param_names(model, optimizer)
    if d.world == 1:
        model.load_state_dict(model_sd)
        optimizer.load_state_dict(optim_sd if _by_index(optim_sd) else
                                  _rekey(optim_sd, {n: i for i, n in enumerate(names)}))
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    if _by_index(optim_sd):  # indices count the same parameters in the same order (model.parameters())
        optim_sd = _rekey(optim_sd, names)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=StateDictOptions(full_state_dict=True))


def broadcast_object(obj, d: Dist):
    """Rank 0's obj on every rank."""
    if d.world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(obj, d: Dist) -> list:
    """[rank 0's obj, rank 1's, ...] on every rank (small picklable objects)."""
    if d.world == 1:
        return [obj]
    out = [None] * d.world
    dist.all_gather_object(out, obj)
    return out


def barrier(d: Dist) -> None:
    if d.world > 1:
        dist.barrier()


def close(d: Dist) -> None:
    if d.weights is not None:  # rollout.mode=async: the weights' group (an engine rank's vLLM keeps its own)
        d.weights.shutdown()
    if d.engine < 0 and d.world > 1 and dist.is_initialized():
        dist.destroy_process_group()
