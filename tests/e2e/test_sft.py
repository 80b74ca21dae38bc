"""scripts/sft.py: worked solutions the reward accepts, SFT data that matches GRPO's prompts and
never contains validation questions, and a toy SFT whose model dir train_grpo.py loads."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from config import load_config
from data import load_splits, render_prompt, reward_last_number, synthetic_arithmetic
from modeling import build_char_tokenizer
from rewards import math_reward

from scripts import sft

ROOT = Path(__file__).resolve().parents[2]

TASK = ROOT / "configs/ablations/base.yaml"


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4, 5])
def test_worked_solution_is_correct_and_rewarded(difficulty):
    max_new = load_config(TASK).rollout.max_new_tokens
    for p in synthetic_arithmetic(3000, difficulty, seed=11):
        text, value = sft.worked_solution(p["question"])
        assert str(value) == p["answer"], (p, text)
        assert math_reward(text, p["answer"], last_number=reward_last_number(load_config(TASK).data)) == 1.0, (p, text)
        assert len(text) + 1 <= max_new  # + EOS fits rollout.max_new_tokens


def test_worked_solution_format():
    assert sft.worked_solution("(37*52)-18=")[0] == "37*52=37*50+37*2=1850+74=1924 1924-18=1906"
    assert sft.worked_solution("23+45*2=")[0] == "45*2=90 23+90=113"
    assert sft.worked_solution("(3-25)*12=")[0] == "3-25=-22 -22*12=-(22*10+22*2)=-(220+44)=-264"
    assert sft.worked_solution("7+2=")[0] == "7+2=9"
    with pytest.raises(ValueError):
        sft.worked_solution("x+1=")


def test_stream_matches_grpo_prompts_and_skips_excluded():
    cfg = load_config(TASK)
    tok = build_char_tokenizer(cfg.model.tiny.vocab)
    _, val = load_splits(cfg.data)
    exclude = {p["question"] for p in val}
    stream = sft.SFTStream({4: 1.0, 5: 1.0}, exclude, tok, cfg.data, seed=0)
    inv = {i: c for c, i in tok.get_vocab().items()}
    seen = 0
    for _ in range(20):
        for prompt_ids, response_ids in stream.batch(64):
            question = "".join(inv[i] for i in prompt_ids[1:])
            assert question not in exclude
            # the trainer tokenizes render_prompt(...) with the BOS the char tokenizer adds
            assert prompt_ids == tok(render_prompt(question, tok, cfg.data))["input_ids"]
            assert response_ids[-1] == tok.eos_token_id
            assert "".join(inv[i] for i in response_ids[:-1]) == sft.worked_solution(question)[0]
            seen += 1
    assert seen == 20 * 64


def test_held_out_sets_are_grpo_val_sets_at_each_level():
    base = load_config(TASK)
    sets = sft.held_out_sets(base.data, {2, 4, 5}, base.train.val_max_prompts)
    for d, problems in sets.items():
        cfg = load_config(TASK, [f"data.synthetic.difficulty={d}"])
        assert problems == load_splits(cfg.data)[1][: cfg.train.val_max_prompts] and problems, d


def test_toy_sft_learns_and_train_grpo_loads_it(tmp_path):
    out = tmp_path / "sft_model"
    result = sft.main(["--out", str(out), "--toy", "--device", "cpu", "--minutes", "5", "--max-steps", "40",
                       "--batch-size", "32", "--lr", "3e-3", "--warmup-steps", "5", "--log-every", "10",
                       "--eval-every-s", "1000", "--dev-size", "8", "--mix", "2:1,5:1",
                       "--task-overrides", "train.val_max_prompts=8"])
    losses = [h["loss"] for h in result["loss_history"]]
    assert result["steps"] == 40 and losses[-1] < 0.75 * losses[0], losses
    saved = json.loads((out / "sft_metrics.json").read_text())
    assert saved["val_size"] == 8 and 0.0 <= saved["val_accuracy"] <= 1.0 and (out / "config.json").is_file()
    assert set(saved["val_accuracy_by_difficulty"]) == {"2", "5"} and saved["task_difficulty"] == 5
    # the SFT dir is a model dir train_grpo.py runs from (CPU: HF engine, emulated FP8, FP8 KV)
    p = subprocess.run([sys.executable, str(ROOT / "train_grpo.py"), "--config", str(ROOT / "configs/ablations/fp8kv_tis.yaml"),
                        f"model.name_or_path={out}", "rollout.engine=hf", "train.device=cpu", f"train.out_dir={tmp_path}",
                        "train.run_name=grpo", "train.steps=2", "rollout.prompts_per_step=4", "rollout.n=4",
                        "train.micro_batch_size=16", "train.val_every=1", "train.val_max_prompts=8",
                        "rollout.max_new_tokens=40"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "grpo/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "mismatch/token_mult_prob_error" in rows[0] and "val/accuracy" in rows[0]


def test_moe_sft_is_the_moe_quickstarts_warm_start(tmp_path):
    """--arch qwen3_moe: the warm start is a Qwen3-MoE model dir that configs/quickstart_moe_gpu.yaml trains
    from (CPU: HF engine, emulated FP8 experts, router replay)."""
    out = tmp_path / "sft_moe_model"
    sft.main(["--out", str(out), "--toy", "--arch", "qwen3_moe", "--experts", "4", "--device", "cpu", "--minutes", "5",
              "--max-steps", "3", "--batch-size", "8", "--eval-every-s", "1000", "--dev-size", "4", "--mix", "2:1",
              "--task-overrides", "train.val_max_prompts=4"])
    hf = json.loads((out / "config.json").read_text())
    assert (hf["model_type"], hf["num_local_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"]) == \
        ("qwen3_moe", 4, 2, 128)
    p = subprocess.run([sys.executable, str(ROOT / "train_grpo.py"), "--config", str(ROOT / "configs/quickstart_moe_gpu.yaml"),
                        f"model.name_or_path={out}", "rollout.engine=hf", "train.device=cpu", f"train.out_dir={tmp_path}",
                        "train.run_name=grpo", "train.steps=1", "rollout.prompts_per_step=2", "rollout.n=4",
                        "train.micro_batch_size=8", "train.val_every=0", "rollout.max_new_tokens=8",
                        "log.tensorboard=false", "train.save_final=false"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    (row,) = [json.loads(line) for line in (tmp_path / "grpo/metrics.jsonl").read_text().splitlines()]
    assert 0.0 <= row["moe/routing_mismatch"] <= 1.0


def test_guess_share_of_task_level_problems_only():
    """--guess F: about F of the task-level (difficulty 5) problems are bare guesses ('?' + the answer,
    which math_reward accepts); easier levels always show their work."""
    cfg = load_config(TASK)
    tok = build_char_tokenizer(cfg.model.tiny.vocab)
    stream = sft.SFTStream({4: 1.0, 5: 1.0}, set(), tok, cfg.data, seed=0, guess=0.7, guess_level=5)
    inv = {i: c for c, i in tok.get_vocab().items()}
    guesses = {4: 0, 5: 0}
    totals = {4: 0, 5: 0}
    for prompt_ids, response_ids in stream.batch(2000):
        question = "".join(inv[i] for i in prompt_ids[1:])
        text = "".join(inv[i] for i in response_ids[:-1])
        work, value = sft.worked_solution(question)
        level = 5 if len(re.findall(r"\d+", question)) == 3 else 4  # a op b vs three terms
        totals[level] += 1
        if text.startswith(sft.GUESS):
            guesses[level] += 1
            assert text == f"{sft.GUESS}{value}"
            assert math_reward(text, str(value), last_number=True) == 1.0
        else:
            assert text == work
    assert guesses[4] == 0 and totals[4] > 500
    assert 0.64 < guesses[5] / totals[5] < 0.76, guesses
