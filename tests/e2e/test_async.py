"""rollout.mode=async on CPU (gloo, HF engine, the whole FP8 recipe with FP8 KV): with
max_staleness 0 the engine ranks reproduce the colocated loop exactly, on 1 and on 2 trainer ranks;
with 1 the engine generates each step with the weights of the step before."""

from test_distributed import ROOT, read, torchrun

COMMON = ["log.tensorboard=false", "log.dump_episodes_every=0", "train.val_every=2", "train.steps=4",
          "train.ckpt_every=0", "rollout.prompts_per_step=8", "train.micro_batch_size=32", "fp8.kv_cache=true",
          "train.device=cpu"]
ASYNC_ONLY = ("rollout/policy_version", "rollout/staleness", "rollout/engine_s")


def launch(tmp_path, name, nproc, *extra):
    torchrun(tmp_path, nproc, "--config", str(ROOT / "configs/tiny_cpu.yaml"), *COMMON, f"train.out_dir={tmp_path}",
             f"train.run_name={name}", *extra, fresh=tmp_path / name)
    return read(tmp_path / name)


def learned(metrics: list[dict]) -> list[dict]:
    """Each step's metrics without timings, memory and the async-only keys."""
    return [{k: v for k, v in m.items() if not k.startswith(("time/", "perf/", "mem/")) and k not in ASYNC_ONLY}
            for m in metrics]


def test_staleness_0_reproduces_the_colocated_loop(tmp_path):
    colocated = {n: launch(tmp_path, f"colocated{n}", n) for n in (1, 2)}
    for trainers, engines in ((1, 1), (2, 1), (2, 2)):
        remote = launch(tmp_path, f"async{trainers}{engines}", trainers + engines, "rollout.mode=async",
                        f"rollout.engine_ranks={engines}", "rollout.max_staleness=0")
        assert learned(remote) == learned(colocated[trainers]), (trainers, engines)
        assert [m["rollout/staleness"] for m in remote if "rollout/staleness" in m] == [0, 0, 0, 0]
        assert [m["rollout/policy_version"] for m in remote if "rollout/policy_version" in m] == [0, 1, 2, 3]


def test_staleness_1_generates_with_the_weights_of_the_step_before(tmp_path):
    colocated = launch(tmp_path, "colocated", 1)
    remote = launch(tmp_path, "async", 2, "rollout.mode=async")  # max_staleness: 1 by default
    assert [m["rollout/policy_version"] for m in remote if "rollout/policy_version" in m] == [0, 0, 1, 2]
    assert [m["rollout/staleness"] for m in remote if "rollout/staleness" in m] == [0, 1, 1, 1]
    assert learned(remote)[0] == learned(colocated)[0]  # step 0: both generate with the initial weights
    for step in (1, 2, 3):  # later, the trainer scores samples of older weights: a larger mismatch
        key = "mismatch/token_mult_prob_error"
        assert remote[step][key] > colocated[step][key], (step, remote[step][key], colocated[step][key])
    assert "val/accuracy" in remote[-1]  # the final validation ran on the last weights


def test_a_resumed_run_restarts_the_engines_where_the_trainer_is(tmp_path):
    """The engines' sampler resumes from the trainer's state: RemoteEngine.generate checks every batch's
    prompts against the trainer's own draw, so a run that finishes drew the same prompts on both sides."""
    launch(tmp_path, "run", 2, "rollout.mode=async", "train.steps=2", "train.ckpt_every=2")
    torchrun(tmp_path, 2, "--resume", str(tmp_path / "run"), "train.steps=4")
    metrics = read(tmp_path / "run")
    # the first step after the resume generates with the checkpoint's weights: staleness 0 again
    assert [m["rollout/staleness"] for m in metrics if "rollout/staleness" in m] == [0, 1, 0, 1]
