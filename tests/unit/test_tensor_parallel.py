"""rollout.tensor_parallel_size: which prompts each rank generates and trains on, the checks, and a
2-rank CPU run whose two ranks share one (HF, emulated) engine group reproducing the 1-rank run."""

import pytest
import torch

import distributed
from config import load_config
from engines.vllm import vllm_engine_kwargs, vllm_env
from errors import UserError
from test_distributed import by_step, launch


@pytest.mark.parametrize("world, tp", [(1, 1), (4, 1), (4, 2), (4, 4), (6, 3)])
def test_rollout_share_covers_every_prompt_once(world, tp):
    P = 12
    trained, gens = [], {}
    for rank in range(world):
        gen, own = distributed.rollout_share(distributed.Dist(rank, world, tp=tp), P)
        assert gen.stop - gen.start == tp * P // world and own.stop - own.start == P // world
        trained += list(range(P))[gen][own]
        gens.setdefault(rank // tp, set()).add((gen.start, gen.stop))
    assert trained == list(range(P))  # rank order = prompt order, each prompt trained exactly once
    assert all(len(g) == 1 for g in gens.values())  # the ranks of a TP group generate the same prompts


def test_tensor_parallel_size_must_divide_the_world(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_config(None, ["rollout.tensor_parallel_size=3", "train.device=cpu", "rollout.prompts_per_step=8"])
    with pytest.raises(UserError, match="tensor_parallel_size=3 must be >= 1 and divide the 2 rank"):
        distributed.init(cfg)
    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg = load_config(None, ["rollout.tensor_parallel_size=2", "train.device=cpu"])
    with pytest.raises(UserError, match="torchrun --nproc_per_node a multiple of 2"):
        distributed.init(cfg)


def test_vllm_kwargs_for_a_tensor_parallel_engine():
    cfg = load_config(None, ["rollout.tensor_parallel_size=2"])
    kw = vllm_engine_kwargs(cfg, "/m", world_size=4)
    assert kw["tensor_parallel_size"] == 2 and kw["distributed_executor_backend"] == "external_launcher"
    # the all-reduce paths that need NVLink multicast memory crashed the first TP forward on an H200 host
    assert kw["disable_custom_all_reduce"] and kw["compilation_config"]["pass_config"]["fuse_allreduce_rms"] is False
    assert vllm_env(cfg)["VLLM_ALLREDUCE_USE_SYMM_MEM"] == "0"
    assert "disable_custom_all_reduce" not in vllm_engine_kwargs(load_config(None, []), "/m", world_size=4)
    with pytest.raises(ValueError, match="needs as many torchrun ranks"):
        vllm_engine_kwargs(cfg, "/m", world_size=1)


def test_two_ranks_sharing_one_engine_group_reproduce_one_rank(tmp_path):
    """Both ranks generate the group's 8 prompts (as vLLM TP ranks do), each trains on its 4: the
    same samples, rewards, validation accuracy and gradients as one rank with all 8."""
    extra = ["fp8.train=false", "fp8.rollout=false"]
    one = launch(tmp_path, "one", 1, extra)
    tp2 = launch(tmp_path, "tp2", 2, [*extra, "rollout.tensor_parallel_size=2"])
    for key in ("reward/mean", "response/length_mean", "val/accuracy"):
        assert by_step(one, key) == by_step(tp2, key), key
    torch.testing.assert_close(by_step(tp2, "optim/grad_norm"), by_step(one, "optim/grad_norm"), rtol=1e-5, atol=0)
