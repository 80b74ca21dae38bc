"""rollout.mode=async: the engines on ranks of their own, one batch ahead of the trainer.

    torchrun --nproc_per_node 2 train_grpo.py --config configs/tiny_cpu.yaml rollout.mode=async

The last rollout.engine_ranks ranks run `serve`; the others train, with `RemoteEngine` as their
engine. distributed.init gives the trainer ranks a default process group of their own (FSDP2,
checkpoints and the loop's reductions are the colocated ones) and every rank a gloo `link`.

Both sides run the same schedule, so nothing but batches and weights crosses the link: an engine
holds its own copy of the data and of the prompt sampler (resumed from the trainer's state at the
start), and for each trainer rank it serves it makes exactly the generate() calls that rank's
colocated engine would make (same prompts, same seeds, same validation share), so its samples do
not depend on how many engines there are.

Weights: version v is what the trainer holds after v optimizer steps. Trainer rank 0 sends each
version to every engine as it refits: the export stream fp8/export.py makes (FP8 bytes and scales
included), each tensor's name, shape and dtype over the link and its bytes by a broadcast over
`d.weights` (NCCL between GPUs, gloo on the CPU), then the q/k/v scales; it marks the version
complete at its next generate() call. The engine applies the tensors as they arrive (it is idle
while it pulls: nothing but the serve loop touches it). The engine generates step t's batch with
version max(t - rollout.max_staleness, first), and answers the trainer's request for step t once
version t is in: with staleness 1 it generates step t + 1 while the trainer trains step t (the
trainer's refit then waits for that generation to end); with staleness 0 it waits, and the loop's
samples are the colocated loop's. Validation at step t runs on version t, as colocated. Each sample
carries its version (Sample.policy_version); the trainer logs rollout/staleness, and the importance
weight uses the engine's own logprobs, so the lag is corrected like any engine/trainer mismatch.

One batch is in flight at a time: an engine sends step t's batch only after it has version t, and
starts step t + 1 only after sending. So the lag is at most 1; deeper queues would overlap no more
when generation and training take similar time.

Engines: the HF engine, or vLLM alone on the engine rank's GPU (a one-rank engine: VLLMEngine under
rollout.mode=async). An engine rank builds the model on the meta device for vLLM, which needs only
its config and module names: the weights arrive from the trainer.
"""

from __future__ import annotations

import math
import pickle
import time

import torch

import distributed
from config import Config
from errors import UserError

TAG = 7


def send(d: distributed.Dist, obj, dst: int) -> None:
    """obj (picklable; tensors on the CPU) to global rank dst over the link."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    d.link.send([torch.tensor([data.numel()])], dst, TAG).wait()
    d.link.send([data], dst, TAG).wait()


def recv(d: distributed.Dist, src: int):
    n = torch.zeros(1, dtype=torch.int64)
    d.link.recv([n], src, TAG).wait()
    data = torch.empty(int(n), dtype=torch.uint8)
    d.link.recv([data], src, TAG).wait()
    return pickle.loads(data.numpy().tobytes())


def broadcast(d: distributed.Dist, t: torch.Tensor) -> None:
    """t's bytes from trainer rank 0 into t on every engine rank, over d.weights; returns once they are
    through (the exporting trainer then frees each tensor before it quantizes the next)."""
    d.weights.broadcast(t, 0).wait()
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()


class RemoteEngine:
    """A trainer rank's engine: generate() returns the batch its engine rank made for this call, the
    rest is trainer rank 0 sending weights (the other ranks take part in the export, which gathers
    sharded weights, and send nothing)."""

    def __init__(self, cfg: Config, d: distributed.Dist):
        self.cfg, self.d = cfg, d
        self.engines = [d.world + j for j in range(d.engines)]
        self.source = d.world + d.rank % d.engines  # the engine rank that serves this trainer rank
        self.version: int | None = None  # the last version sent
        self.pending = False  # sent, not yet marked complete
        self.generate_s = 0.0  # the engine's seconds on the last batch it sent

    def start(self, step: int, sampler_state: dict) -> None:
        """The engines' schedule starts at `step`, their samplers at the trainer's state (rank 0 sends)."""
        self.version = step - 1
        self._to_engines(("start", step, sampler_state))

    def _to_engines(self, msg) -> None:
        if self.d.main:
            for e in self.engines:
                send(self.d, msg, e)

    def update_weights(self, weights) -> None:
        self.version += 1
        for name, t in weights:  # every trainer rank iterates: the export's gathers are collective
            if self.d.main:  # the bytes of any dtype (float8 included), on the group's device
                self._to_engines(("tensor", name, tuple(t.shape), str(t.dtype).removeprefix("torch.")))
                broadcast(self.d, t.detach().to(self.d.device).contiguous().reshape(-1).view(torch.uint8))
        self.pending = True

    def set_kv_scales(self, scales) -> None:
        self._to_engines(("scales", scales))

    def _complete(self) -> None:
        if self.pending:
            self._to_engines(("version", self.version))
            self.pending = False

    def generate(self, prompt_ids, n, temperature, top_p, max_new_tokens, seed=None):
        self._complete()
        kind, prompts, samples, self.generate_s = recv(self.d, self.source)
        if prompts != prompt_ids:  # the two schedules disagree: a bug, never a silent wrong batch
            raise RuntimeError(f"rollout.mode=async: engine rank {self.source} sent a {kind} batch for other "
                               "prompts than this trainer rank asked for")
        return samples

    def sleep(self) -> None:  # the engines have GPUs of their own
        pass

    def wake(self) -> None:
        pass

    def close(self) -> None:
        """The last version complete, then the engines stop."""
        self._complete()
        self._to_engines(("stop",))


class _Weights:
    """The engine rank's side of the weight stream."""

    def __init__(self, d: distributed.Dist, engine):
        self.d, self.engine, self.version, self.stopped = d, engine, -1, False
        self.after = None  # the message that ended the last run of tensors (_tensors)

    def pull(self, version: int) -> None:
        """Apply what trainer rank 0 sends until `version` is complete (or the trainer stops)."""
        msg = None
        while self.version < version and not self.stopped:
            msg = msg or recv(self.d, 0)
            if msg[0] == "tensor":  # a run of tensors: streamed into the engine, up to the next message
                run = self._tensors(msg)
                self.engine.update_weights(run)
                if next(run, None) is not None:
                    raise RuntimeError("the engine's update_weights left tensors of the stream unread")
                msg = self.after
                continue
            if msg[0] == "scales":
                self.engine.set_kv_scales(msg[1])
            elif msg[0] == "version":
                self.version = msg[1]
            else:
                self.stopped = msg[0] == "stop"
            msg = None

    def _tensors(self, msg):
        """(name, tensor) from the header `msg` on, each one's bytes by broadcast; the first message that
        is not a tensor's header ends the run and is kept in self.after."""
        while msg[0] == "tensor":
            _, name, shape, dtype = msg
            dtype = getattr(torch, dtype)
            buf = torch.empty(math.prod(shape) * dtype.itemsize, dtype=torch.uint8, device=self.d.device)
            broadcast(self.d, buf)
            yield name, buf.view(dtype).view(shape)
            msg = recv(self.d, 0)
        self.after = msg


def serve(cfg: Config, d: distributed.Dist) -> None:
    """An engine rank: generate the schedule's batches for the trainer ranks it serves until the
    trainer stops it."""
    import dataclasses

    import observe
    from data import PromptSampler, load_data
    from engines import make_engine
    from modeling import load_model_and_tokenizer
    from rollout import step_seed

    torch.manual_seed(cfg.train.seed)
    on_vllm = cfg.rollout.engine == "vllm"
    if on_vllm and d.device.type != "cuda":
        raise UserError(f"rollout.engine=vllm needs a CUDA GPU on each engine rank (rank {d.world + d.engine} has "
                        f"{d.device}); set rollout.engine=hf")
    # vLLM reads the model's config and module names only; the HF engine generates with the model
    model, tokenizer = load_model_and_tokenizer(cfg.model, torch.device("meta") if on_vllm else d.device)
    quiet = observe.RunLogger(None, enabled=False, tensorboard=False)
    train_set, val_set = load_data(cfg, tokenizer, quiet)
    engine = make_engine(cfg, model, tokenizer, d.device)
    served = [r for r in range(d.world) if r % d.engines == d.engine]
    r_cfg, t_cfg = cfg.rollout, cfg.train
    msg = recv(d, 0)
    assert msg[0] == "start", msg
    first = msg[1]
    sampler = PromptSampler(train_set, r_cfg.prompts_per_step, seed=cfg.data.seed)
    sampler.load_state_dict(msg[2])
    weights = _Weights(d, engine)

    def generate(calls: dict, version: int) -> tuple[dict, float]:
        """{trainer rank: (prompts, samples)} of each rank's call, and the seconds they took."""
        t0, made = time.perf_counter(), {}
        for r, (prompts, kw) in calls.items():
            made[r] = prompts, [dataclasses.replace(s, policy_version=version) for s in engine.generate(prompts, **kw)]
        return made, time.perf_counter() - t0

    def deliver(kind: str, made: dict, seconds: float) -> None:
        for r, (prompts, samples) in made.items():
            send(d, (kind, prompts, samples, seconds), r)

    def val_calls() -> dict:
        val = val_set[: t_cfg.val_max_prompts]
        return {r: ([ex["prompt_ids"] for ex in val[r:: d.world]],
                    {"n": 1, "temperature": 0.0, "top_p": 1.0, "max_new_tokens": r_cfg.max_new_tokens}) for r in served}

    for step in range(first, t_cfg.steps):
        weights.pull(max(step - r_cfg.max_staleness, first))
        batch, used = next(sampler), weights.version
        calls = {}
        for r in served:  # exactly the colocated rank r's call (trainer.rollout_round)
            gen, _ = distributed.rollout_share(distributed.Dist(r, d.world), r_cfg.prompts_per_step)
            calls[r] = ([ex["prompt_ids"] for ex in batch[gen]],
                        {"n": r_cfg.n, "temperature": r_cfg.temperature, "top_p": r_cfg.top_p,
                         "max_new_tokens": r_cfg.max_new_tokens,
                         "seed": step_seed(r_cfg, t_cfg.seed, step) + gen.start * r_cfg.n})
        made, seconds = generate(calls, used)
        print(f"engine {d.engine}: step {step} generated with version {used} in {seconds:.1f} s", flush=True)
        weights.pull(step)  # the trainer asks for step t once it has sent version t
        if t_cfg.val_every and step % t_cfg.val_every == 0:
            deliver("validation", *generate(val_calls(), weights.version))
        deliver("rollout", made, seconds)
    weights.pull(t_cfg.steps)
    if t_cfg.val_every and not weights.stopped:
        deliver("validation", *generate(val_calls(), weights.version))
    weights.pull(t_cfg.steps + 1)  # until the trainer's stop
