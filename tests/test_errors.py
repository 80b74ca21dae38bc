"""Bad input and unsupported hardware: each message names the problem and the fix.

Covered elsewhere (not repeated here): unknown config keys, wrong types, bad enum values
(test_config.py); a missing model dir and a dataset without the named fields, through the CLI
(test_train.py, test_data.py); math-verify exceptions and timeouts scoring 0 and counted in
reward_stats (test_data.py::test_error_counter); export_hf.py sources (test_export.py).
"""

import sys

import pytest
import torch
import yaml

import train_grpo
from config import FP8Config, load_config, to_dict
from conftest import ROOT
from fp8 import linear as fp8_linear


def main_error(capsys, argv) -> str:
    """train_grpo.main must exit 2 with a one-line 'error: ...' on stderr; returns that line."""
    with pytest.raises(SystemExit) as e:
        train_grpo.main(argv)
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and lines[-1].startswith("error: ")
    return lines[-1]


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
    assert fp8_linear.convert_to_fp8_training(model, FP8Config(train=True)) == []
    out = capsys.readouterr().out
    assert "converted 0 linears" in out and "dims 64x64 not divisible by 128" in out
    assert "WARNING fp8: no linear is FP8, the whole model runs in BF16" in out and "multiples of 128" in out


def test_vllm_missing_names_the_install_command(tmp_path, monkeypatch, capsys):
    from rollout import vllm_env

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", ["rollout.engine=vllm"])
    for key in vllm_env(cfg):  # the engine sets these before importing vllm: restore them afterwards
        monkeypatch.setenv(key, "")
    err = main_error(capsys, ["--config", str(ROOT / "configs/tiny_cpu.yaml"), f"train.out_dir={tmp_path}",
                              "log.tensorboard=false", "rollout.engine=vllm"])
    assert "rollout.engine=vllm but vllm does not import (ModuleNotFoundError: " in err
    assert "`pip install vllm==0.26.0`" in err and "or set rollout.engine=hf" in err


def test_resume_errors(tmp_path, capsys):
    err = main_error(capsys, ["--resume", str(tmp_path)])
    assert err == f"error: --resume {tmp_path}: not a run directory (no config.yaml)"
    # a run dir whose only checkpoint is a crashed save
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", ["log.tensorboard=false", f"train.out_dir={tmp_path}"])
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
    (tmp_path / "checkpoints" / ".tmp-step_000002").mkdir(parents=True)
    (tmp_path / "checkpoints" / ".tmp-step_000002" / "state.pt").write_bytes(b"torn")
    err = main_error(capsys, ["--resume", str(tmp_path)])
    assert err == f"error: --resume {tmp_path}: no complete checkpoint in {tmp_path / 'checkpoints'}"
