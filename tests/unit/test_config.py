"""Config: inheritance, overrides, errors naming the key; every YAML in configs/ and bench/ loads."""

import re
from pathlib import Path

import pytest

from config import Config, ConfigError, describe, field_docs, load_config, to_dict
from losses.advantages import ADVANTAGE_ESTIMATORS
from losses.grpo import AGGS, IS_CORRECTIONS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted([*(ROOT / "configs").rglob("*.yaml"), *(ROOT / "bench").glob("*.yaml")]),
                         ids=lambda p: p.name)
def test_every_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)


def test_describe_reads_back_as_the_same_config(tmp_path):
    """describe (train_grpo.py --print-config): every shipped config, printed with its docs, loads back
    as itself; each documented field's doc sits in comments right above it."""
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        cfg = load_config(path)
        (tmp_path / "described.yaml").write_text(describe(cfg))
        assert to_dict(load_config(tmp_path / "described.yaml")) == to_dict(cfg), path
    text = describe(load_config(None, ["optim.lr=3e-7"]))
    assert "optim:\n" in text and "  lr: 3.0e-07\n" in text and "  betas: [0.9, 0.999]\n" in text
    doc = field_docs(type(Config().train))["steps"]
    assert doc.startswith("Rollout steps") and f"  # {doc}\n  steps: 100\n" in text


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_base_inheritance_and_override_order(tmp_path):
    write(tmp_path, "a.yaml", "loss: {is_cap: 3.0, clip_low: 0.1}\nrollout: {n: 4}\n")
    write(tmp_path, "b.yaml", "base: a.yaml\nloss: {is_cap: 5.0}\n")
    cfg = load_config(tmp_path / "b.yaml", ["rollout.n=16", "fp8.kv_cache=true", "fp8.keep_bf16=['*.down_proj']"])
    assert cfg.loss.is_cap == 5.0  # child wins
    assert cfg.loss.clip_low == 0.1  # inherited, merged per key
    assert cfg.rollout.n == 16  # CLI wins over files
    assert cfg.fp8.kv_cache is True and cfg.fp8.keep_bf16 == ["*.down_proj"]
    assert cfg.loss.clip_high == 0.2  # dataclass default


def test_int_and_exponent_strings_accepted_for_float():
    assert load_config(None, ["loss.is_cap=5"]).loss.is_cap == 5.0
    assert load_config(None, ["optim.lr=1e-4"]).optim.lr == 1e-4  # YAML 1.1 reads 1e-4 as a string
    with pytest.raises(ConfigError, match="optim.lr: expected a number, got 'fast'"):
        load_config(None, ["optim.lr=fast"])


@pytest.mark.parametrize("override, message", [
    ("train.steps=ten", "train.steps: expected an integer, got 'ten'"),
    ("train.steps=2.5", "train.steps: expected an integer, got float 2.5"),
    ("optim.lr=fast", "optim.lr: expected a number, got 'fast'"),
    ("fp8.train=maybe", "fp8.train: expected true or false, got 'maybe'"),
    ("rollout.n=8: 4", "rollout.n: expected an integer, got dict {8: 4} (override values are read as YAML)"),
    ("fp8.keep_bf16=[1]", "fp8.keep_bf16[0]: expected a string, got int 1 (override values are read as YAML: "
                          "quote a string, e.g. fp8.keep_bf16=\"['...']\")"),
])
def test_wrong_type_says_the_type_expected(override, message):
    """A number that is not one names the type it must be; the advice about YAML's reading comes only where
    YAML's reading is the cause (a mapping, a number where a string is wanted)."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value) == message


@pytest.mark.parametrize("override, message", [
    (["loss.is_capp=5"], r"unknown config key 'loss.is_capp'"),
    (["los.is_cap=5"], r"unknown config key 'los'"),
    (["rollout.n=eight"], r"rollout.n: expected an integer, got 'eight'"),
    (["fp8.train=1"], r"fp8.train: expected true or false, got int"),
    (["rollout.engine=sglang"], r"rollout.engine: 'sglang' is not one of \['hf', 'vllm'\]"),
    (["loss.is_correction=tiss"], r"loss: .*is_correction.*tiss"),
    (["fp8.keep_bf16=lm_head"], r"fp8.keep_bf16: expected a list"),
    (["rollout.n=1"], r"rollout.n=1: must be >= 2"),
    (["train.mini_batch_size=100"], r"train.mini_batch_size=100: must be 0 \(all samples\) or divide"),
    (["data.source=jsonl"], r"data.path='': must be set for data.source=jsonl"),
    (["rollout.max_num_seqs=-1"], r"rollout.max_num_seqs=-1: must be >= 0 \(0 = vLLM's default\)"),
    (["rollout.block_size=24"], r"rollout.block_size=24: must be 0 \(vLLM's default\) or a multiple of 16"),
    (["rollout.ignore_eos_median=1400"], r"rollout.ignore_eos_median=1400: must be 0, or >= 1 with rollout.ignore_eos"),
    (["rollout.kv_cache_gib=-1"], r"rollout.kv_cache_gib=-1.0: must be >= 0"),
    (["noequals"], r"must look like section.key=value"),
])
def test_errors_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, override)


@pytest.mark.parametrize("config", ["tiny_gpu.yaml", "quickstart_gpu.yaml"])
def test_old_logp_from_the_rollout_goes_with_the_entropy_bonus(config):
    """The bypass (train.old_logp=rollout) measures policy/entropy in the training forward, so it is
    accepted beside the adaptive entropy bonus of the configs that use it, and beside a fixed one."""
    cfg = load_config(ROOT / "configs" / config, ["train.old_logp=rollout"])
    assert cfg.train.old_logp == "rollout" and cfg.loss.entropy_target is not None
    cfg = load_config(None, ["train.old_logp=rollout", "loss.entropy_target=0.5", "loss.entropy_coef=0.01"])
    assert (cfg.loss.entropy_target, cfg.loss.entropy_coef) == (0.5, 0.01)


@pytest.mark.parametrize("key, names", [("loss.is_correction", IS_CORRECTIONS), ("loss.agg", AGGS),
                                        ("advantage.estimator", ADVANTAGE_ESTIMATORS)])
def test_variant_names_come_from_the_registry(key, names):
    """Every registered name loads; any other is refused naming the key and every registered name."""
    section, field = key.split(".")
    for name in names:
        assert getattr(getattr(load_config(None, [f"{key}={name}"]), section), field) == name
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{key}=no_such_variant"])
    assert field in str(e.value) and "no_such_variant" in str(e.value)
    assert all(repr(name) in str(e.value) for name in names), str(e.value)


ZERO_OUTSIDE_WINDOW = ("icepop", "seq_mask_tis")  # the IS corrections that zero weights outside [is_floor, is_cap]


@pytest.mark.parametrize("correction", IS_CORRECTIONS)
def test_an_is_window_must_hold_ratio_1(correction):
    """[is_floor, is_cap] without 1 is refused where the correction zeroes weights outside it: a token engine and
    trainer agree on has weight 1. tis and seq_tis only cap (a cap below 1 scales every weight) and none uses
    neither, so those load."""
    for floor, cap, key in [(0.5, 0.9, "loss.is_cap=0.9"), (1.5, 3.0, "loss.is_floor=1.5")]:
        overrides = [f"loss.is_correction={correction}", f"loss.is_floor={floor}", f"loss.is_cap={cap}"]
        if correction in ZERO_OUTSIDE_WINDOW:
            with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: must be [<>]= 1 with loss.is_correction="):
                load_config(None, overrides)
        else:
            assert load_config(None, overrides).loss.is_cap == cap
    load_config(None, [f"loss.is_correction={correction}", "loss.is_floor=1", "loss.is_cap=1"])  # [1, 1] holds 1


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    write(tmp_path, "loop.yaml", "base: loop.yaml\n")
    with pytest.raises(ConfigError, match="circular"):
        load_config(tmp_path / "loop.yaml")
    write(tmp_path, "bad.yaml", "loss: [1, 2\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(tmp_path / "bad.yaml")
    write(tmp_path, "nested_typo.yaml", "model:\n  tiny:\n    hiden_size: 64\n")
    with pytest.raises(ConfigError, match="model.tiny.hiden_size"):
        load_config(tmp_path / "nested_typo.yaml")
