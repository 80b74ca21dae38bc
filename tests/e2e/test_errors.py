"""Bad input and unsupported hardware: each message names the problem and the fix, exits 2, and
leaves no run dir behind (BAD_INPUT: the table, train_grpo.py run in-process by conftest.run_train).

Covered elsewhere (not repeated here): unknown config keys, wrong types, bad enum values
(test_config.py); a missing model dir and a dataset without the named fields, through the CLI
(test_train.py, test_data.py); math-verify exceptions and timeouts scoring 0 and counted in
reward_stats (test_data.py::test_error_counter); export_hf.py sources (test_export.py).
"""

import sys

import pytest
import torch
import yaml

import run_setup
from config import FP8Config, load_config, to_dict
from conftest import ROOT, run_train
from errors import UserError
from fp8 import linear as fp8_linear
from fp8.convert import convert_to_fp8_training


def main_error(argv) -> str:
    """train_grpo.py must exit 2 with a one-line 'error: ...' on stderr; returns that line."""
    run = run_train(*argv)
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.error.startswith("error: "), run.stderr[-3000:]
    return run.error


def test_fp8_on_a_gpu_without_sm90_emulates_with_a_warning(monkeypatch, capsys):
    """Decision: not an error (the FP8 recipe still runs, e.g. for debugging on an A100), but the
    emulation is slow, so say so once and name the knobs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    fp8_linear._warn_not_sm90.cache_clear()
    cfg = FP8Config(train=True)
    assert not fp8_linear.use_torchao(cfg, "cuda:0") and not fp8_linear.use_torchao(cfg, "cuda:0")
    err = capsys.readouterr().err
    assert err.count("WARNING fp8") == 1  # once per process
    assert "NVIDIA A100-SXM4-80GB is sm_80" in err and "need SM90 (H100/H200)" in err and "EMULATED" in err
    assert "fp8.emulate=true" in err and "fp8.train=false" in err
    assert not fp8_linear.use_torchao(FP8Config(train=True, emulate=True), "cuda:0")  # asked for: no warning
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8_linear.use_torchao(cfg, "cuda:0") and not fp8_linear.use_torchao(cfg, "cpu")
    assert "WARNING" not in capsys.readouterr().err
    fp8_linear._warn_not_sm90.cache_clear()


def test_dims_not_divisible_by_128_fall_back_to_bf16_loudly(capsys):
    """Per layer: logged with the reason (fp8_plan); no layer at all: a warning naming the rule."""
    from modeling import build_char_tokenizer, build_tiny_model

    cfg = load_config(None, ["model.tiny.hidden_size=64", "model.tiny.intermediate_size=256",
                             "model.tiny.head_dim=16"])
    tok = build_char_tokenizer(cfg.model.tiny.vocab)
    model = build_tiny_model(cfg.model.tiny, tok, torch.float32)
    assert convert_to_fp8_training(model, FP8Config(train=True)) == []
    out = capsys.readouterr().out
    assert "converted 0 linears" in out and "dims 64x64 not divisible by 128" in out
    assert "WARNING fp8: no linear is FP8, the whole model runs in BF16" in out and "multiples of 128" in out


def test_vllm_missing_names_the_install_command(monkeypatch):
    from engines.vllm import vllm_env
    from modeling import build_char_tokenizer, build_tiny_model
    from engines import make_engine

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", ["rollout.engine=vllm"])
    for key in vllm_env(cfg):  # the engine sets these before importing vllm: restore them afterwards
        monkeypatch.setenv(key, "")
    tok = build_char_tokenizer(cfg.model.tiny.vocab)
    with pytest.raises(UserError) as e:  # (on a CPU host train_grpo stops earlier: vllm needs a CUDA GPU)
        make_engine(cfg, build_tiny_model(cfg.model.tiny, tok, torch.float32), tok, torch.device("cpu"))
    assert "rollout.engine=vllm but vllm does not import (ModuleNotFoundError: " in str(e.value)
    assert "`pip install vllm==0.26.0`" in str(e.value) and "or set rollout.engine=hf" in str(e.value)


def test_resume_errors(tmp_path):
    err = main_error(["--resume", str(tmp_path)])
    assert err == f"error: --resume {tmp_path}: not a run directory (no config.yaml)"
    # a run dir whose only checkpoint is a crashed save
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", ["log.tensorboard=false", f"train.out_dir={tmp_path}"])
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
    (tmp_path / "checkpoints" / ".tmp-step_000002").mkdir(parents=True)
    (tmp_path / "checkpoints" / ".tmp-step_000002" / "state.pt").write_bytes(b"torn")
    err = main_error(["--resume", str(tmp_path)])
    assert err == (f"error: --resume {tmp_path}: no complete checkpoint in {tmp_path / 'checkpoints'}, so it cannot "
                   "be resumed; start a new run (another train.run_name), or delete that directory")
    assert (tmp_path / "config.yaml").is_file()  # a resumed run's dir is never removed


# ---------------------------------------------------------------------------- the bad-input table
# override(s) -> a substring of the one-line error. Config rules fire in load_config, before any model
# is built (milliseconds); the rest (marked slow in the comment) after the run dir exists, which the
# failed run must remove again.

BAD_INPUT = [
    # settings that stop or reverse learning
    (["optim.warmup_steps=-3"], "optim.warmup_steps=-3: must be >= 0 (a negative warm-up gives a negative lr)"),
    (["optim.lr=-1e-3"], "optim.lr=-0.001: must be > 0"),
    (["optim.lr=0"], "optim.lr=0.0: must be > 0 (0 never moves the weights"),
    (["optim.lr=nan"], "optim.lr=nan: must be a number, not NaN"),
    (["optim.lr=inf"], "optim.lr=inf: must be a finite number"),
    (["optim.betas=[0.9]"], "optim.betas=[0.9]: must be two numbers in [0, 1)"),
    (["optim.betas=[0.9, 1.0]"], "optim.betas=[0.9, 1.0]: must be two numbers in [0, 1)"),
    (["optim.eps=0"], "optim.eps=0.0: must be > 0"),
    (["optim.max_grad_norm=0"], "optim.max_grad_norm=0.0: must be > 0, or null for no clipping"),
    (["loss.is_cap=0"], "loss.is_cap=0.0: must be > 0 (0 zeroes every importance weight"),
    (["loss.clip_low=-0.1"], "loss: LossConfig: need 0 <= clip_low < 1 and clip_high >= 0, got clip_low=-0.1"),
    (["loss.is_correction=icepop", "loss.is_floor=3"], "loss: LossConfig: need 0 <= is_floor <= is_cap, got "
                                                       "is_floor=3.0, is_cap=2.0"),
    # a masking window without ratio 1 takes every token out of the gradient (tis / seq_tis only cap: allowed)
    (["loss.is_correction=icepop", "loss.is_floor=0.5", "loss.is_cap=0.9"],
     "loss.is_cap=0.9: must be >= 1 with loss.is_correction=icepop: a token engine and trainer agree on has weight 1"),
    (["loss.is_correction=seq_mask_tis", "loss.is_floor=1.5", "loss.is_cap=3"],
     "loss.is_floor=1.5: must be <= 1 with loss.is_correction=seq_mask_tis: a token engine and trainer agree on has "
     "weight 1 (nearly every other one is near it), so a window [loss.is_floor, loss.is_cap] without 1 takes every "
     "token out of the gradient"),
    (["loss.entropy_coef=-0.01"], "loss.entropy_coef=-0.01: must be >= 0 (a negative bonus drives entropy down)"),
    (["loss.entropy_target=0"], "loss.entropy_target=0.0: must be > 0 nats, or null"),
    (["model.tiny.arch=gpt2"], "model.tiny.arch='gpt2': must be one of 'llama', 'qwen3', 'qwen3_moe' (a family file in models/)"),
    (["rollout.n=1"], "rollout.n=1: must be >= 2: group-normalised advantages"),
    (["rollout.temperature=0"], "rollout.temperature=0.0: must be > 0"),
    (["train.steps=-1"], "train.steps=-1: must be >= 1"),
    (["train.micro_batch_size=0"], "train.micro_batch_size=0: must be >= 1"),
    (["train.mini_batch_size=7"], "train.mini_batch_size=7: must be 0 (all samples) or divide"),
    (["train.val_max_prompts=0"], "train.val_max_prompts=0: must be >= 1 while train.val_every > 0"),
    (["train.device=foo"], "train.device='foo': must be auto, cpu, cuda or cuda:N"),
    # names chosen from a registry, and the advantage settings
    (["data.reward=maths"], "data.reward='maths': must be one of 'math', 'format' (rewards.REWARDS)"),
    (["advantage.estimator=rloo"], "advantage.estimator='rloo': must be one of 'grpo' "
                                   "(losses.advantages.ADVANTAGE_REGISTRY)"),
    (["advantage.eps=0"], "advantage.eps=0.0: must be > 0"),
    (["advantage.eps=inf"], "advantage.eps=inf: must be a finite number"),
    (["advantage.normalise_std=false"], "unknown config key 'advantage.normalise_std' (valid keys in this section: "
                                        "estimator, normalize_std, eps)"),
    # wrong types name the type expected; where YAML read the override as a mapping, the error says so
    (["optim.lr=fast"], "optim.lr: expected a number, got 'fast'"),
    (["train.steps=ten"], "train.steps: expected an integer, got 'ten'"),
    (["rollout.n=8: 4"], "rollout.n: expected an integer, got dict {8: 4} (override values are read as YAML"),
    # rollout.mode=async: what it cannot run yet, and a launch without engine ranks
    (["rollout.mode=async", "rollout.max_staleness=2"], "rollout.max_staleness=2: must be 0 or 1"),
    (["rollout.mode=async", "train.dynamic_sampling=resample"],
     "train.dynamic_sampling='resample': must be none or filter with rollout.mode=async"),
    (["rollout.mode=async"], "rollout.mode=async with rollout.engine_ranks=1 needs more than 1 ranks"),
    # past the config (slow: a model is built)
    (["rollout.engine=vllm", "train.device=cpu"], "rollout.engine=vllm needs a CUDA GPU (the device is cpu); set "
                                                  "rollout.engine=hf"),
    (["model.name_or_path=/nonexistent/model"], "model.name_or_path: '/nonexistent/model' is not a model directory"),
    (["model.name_or_path=no-such-org/no-such-model"], "model.name_or_path: cannot load 'no-such-org/no-such-model'"),
    (["data.source=jsonl", "data.path=DATA", "data.prompt_field=question"], "no field 'question' (data.prompt_field)"),
    (["data.instruction=Say it."], "model.tiny.vocab lacks characters the prompts use: '.Saity'"),
]


@pytest.mark.parametrize("overrides, message", BAD_INPUT, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_bad_input_is_one_line_exit_2_and_leaves_no_run_dir(overrides, message, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # an hf id on a host without network
    (tmp_path / "d.jsonl").write_text('{"problem": "1+1=", "answer": "2"}\n')
    out = tmp_path / "runs"
    overrides = [o.replace("DATA", str(tmp_path / "d.jsonl")) for o in overrides]
    err = main_error(["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"train.out_dir={out}",
                              "log.tensorboard=true", *overrides])
    assert message in err, err
    assert not out.exists() or not list(out.iterdir()), list(out.iterdir())


def test_str_overrides_are_taken_as_written():
    """A str field takes the override's text as it is: YAML would read '#### (.*)' as a comment (None),
    '123' as an int and 'a: b' as a mapping."""
    cfg = load_config(None, ["data.answer_regex=#### (.*)", "train.run_name=123", "data.instruction=Answer: 5",
                             "data.system_prompt=", "optim.max_grad_norm=null"])
    assert cfg.data.answer_regex == "#### (.*)" and cfg.train.run_name == "123"
    assert cfg.data.instruction == "Answer: 5" and cfg.data.system_prompt == ""
    assert cfg.optim.max_grad_norm is None  # no clipping


def test_run_dirs_are_created_exclusively(tmp_path, monkeypatch):
    """Two runs started in the same second get two dirs (name, name-2); threads racing for one name each
    get their own; an explicit train.run_name that exists is refused and left alone."""
    import threading

    from checkpoint import create_run_dir
    from distributed import Dist

    class Frozen(run_setup.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 1, 2, 3, 4, 5)
    monkeypatch.setattr(run_setup, "datetime", Frozen)
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", [f"train.out_dir={tmp_path}"])
    dirs = [run_setup.make_run_dir(cfg, "configs/tiny_cpu.yaml", Dist()) for _ in range(2)]
    assert dirs == [tmp_path / "tiny_cpu-20260102-030405", tmp_path / "tiny_cpu-20260102-030405-2"]

    got = []
    threads = [threading.Thread(target=lambda: got.append(create_run_dir(tmp_path / "race", "r", auto=True)))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 8 and {p.name for p in got} == {"r", *(f"r-{i}" for i in range(2, 9))}

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(UserError, match="train.run_name: .*mine exists .* pick another train.run_name"):
        run_setup.make_run_dir(load_config(None, [f"train.out_dir={tmp_path}", "train.run_name=mine"]), None, Dist())
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
