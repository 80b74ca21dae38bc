"""Real math data: configs/gsm8k.yaml and configs/math.yaml run a step on CPU (tiny model, local
JSONL in GSM8K's / MATH's own row formats); local parquet / JSONL / save_to_disk loading with
max_examples; the overlong-prompt and worked-solution warnings; `#` in a command-line answer_regex."""

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest

from config import DataConfig, load_config
from data import DataError, data_warnings, load_splits, looks_like_solution

ROOT = Path(__file__).resolve().parents[2]

# rows in the datasets' own formats (openai/gsm8k 'main'; MATH: problem / level / solution / type)
GSM8K_ROWS = [{"question": f"Natalia sold clips to {n} of her friends in April, and then she sold half as many "
                           f"clips in May. How many clips did Natalia sell altogether in April and May?",
               "answer": f"Natalia sold {n}/2 = <<{n}/2={n // 2}>>{n // 2} clips in May.\n"
                         f"Natalia sold {n}+{n // 2} = <<{n}+{n // 2}={n + n // 2}>>{n + n // 2} clips altogether "
                         f"in April and May.\n#### {n + n // 2}"} for n in range(40, 80, 2)]
MATH_ROWS = [{"problem": f"Simplify $\\sqrt{{{9 * k * k * 13}}}$.", "level": "Level 2", "type": "Algebra",
              "solution": f"We have $\\sqrt{{{9 * k * k * 13}}} = \\sqrt{{{9 * k * k}}}\\cdot\\sqrt{{13}} = "
                          f"\\boxed{{{3 * k}\\sqrt{{13}}}}$."} for k in range(1, 21)]


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_gsm8k_and_math_rows_give_final_answers(tmp_path):
    cfg = load_config(ROOT / "configs/gsm8k.yaml", ["data.source=jsonl", f"data.path={_jsonl(tmp_path / 'g.jsonl', GSM8K_ROWS)}",
                                                    "data.val_split=", "data.val_size=5"])
    train, val = load_splits(cfg.data)
    assert sorted(int(e["answer"]) for e in train + val) == sorted(n + n // 2 for n in range(40, 80, 2))
    assert not data_warnings(train, 0, cfg.data)
    cfg = load_config(ROOT / "configs/math.yaml", ["data.source=jsonl", f"data.path={_jsonl(tmp_path / 'm.jsonl', MATH_ROWS)}",
                                                   "data.val_split=", "data.val_size=5"])
    train, val = load_splits(cfg.data)
    assert sorted(e["answer"] for e in train + val) == sorted(f"{3 * k}\\sqrt{{13}}" for k in range(1, 21))
    assert not data_warnings(train, 0, cfg.data)


def test_answer_regex_with_hash_from_command_line(tmp_path):
    path = _jsonl(tmp_path / "g.jsonl", GSM8K_ROWS)
    cfg = load_config(None, ["data.source=jsonl", f"data.path={path}", "data.prompt_field=question",
                             "data.answer_regex=#### (.*)", "data.val_size=2"])
    assert cfg.data.answer_regex == "#### (.*)"
    assert load_config(None, ["data.answer_regex='#### (.*)'"]).data.answer_regex == "#### (.*)"   # quoted: YAML
    assert load_config(None, ["data.instruction=Put it in #1"]).data.instruction == "Put it in #1"
    assert load_config(None, ["data.max_prompt_tokens=64"]).data.max_prompt_tokens == 64             # not a str field
    train, _ = load_splits(cfg.data)
    assert all(e["answer"].isdigit() for e in train)


def test_solution_and_overlong_warnings(tmp_path):
    # GSM8K without answer_regex: the gold "answer" is the whole worked solution
    cfg = DataConfig(source="jsonl", path=_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS), prompt_field="question", val_size=0)
    train, _ = load_splits(cfg)
    (w,) = data_warnings(train, 0, cfg)
    assert "data.answer_field='answer'" in w and "worked solutions" in w and "answer_regex='#### (.*)'" in w
    cfg = DataConfig(source="jsonl", path=_jsonl(tmp_path / "m.jsonl", MATH_ROWS), answer_field="solution", val_size=0)
    train, _ = load_splits(cfg)
    (w,) = data_warnings(train, 0, cfg)
    assert "data.answer_field='solution'" in w and "data.answer_boxed=true" in w
    # overlong: warn above 10% dropped, not at 10%
    exs = [{"question": "q", "answer": "1"}] * 90
    assert data_warnings(exs, 10, DataConfig()) == []
    (w,) = data_warnings(exs, 11, DataConfig(max_prompt_tokens=64))
    assert "11 of 101 prompts (10.9%)" in w and "data.max_prompt_tokens=64" in w
    for ans in ["72", "3\\sqrt{13}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\text{Devon}", "(-\\infty, 0]"]:
        assert not looks_like_solution(ans)
    assert looks_like_solution("We add. Then we divide by two to get the result. So 5.")


def test_answer_boxed_errors(tmp_path):
    rows = [{"problem": "p", "solution": "no box here"}]
    with pytest.raises(DataError, match="data.answer_boxed True matched none.*fix data.answer_boxed"):
        load_splits(DataConfig(source="jsonl", path=_jsonl(tmp_path / "m.jsonl", rows), answer_field="solution",
                               answer_boxed=True, val_size=0))


@pytest.fixture(scope="module")
def local_formats(tmp_path_factory):
    import datasets
    root = tmp_path_factory.mktemp("math")
    ds = datasets.Dataset.from_list(MATH_ROWS)
    ds.to_parquet(str(root / "train.parquet"))
    datasets.DatasetDict({"train": ds, "test": ds.select(range(3))}).save_to_disk(str(root / "saved"))
    _jsonl(root / "train.jsonl", MATH_ROWS)
    return root


@pytest.mark.parametrize("source, name", [("hf", "train.parquet"), ("hf", "saved"), ("hf", "train.jsonl"),
                                          ("jsonl", "train.jsonl")])
def test_local_formats_and_max_examples(local_formats, tmp_path, monkeypatch, source, name):
    import datasets
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    base = dict(source=source, path=str(local_formats / name), prompt_field="problem", answer_field="solution",
                answer_boxed=True, val_size=2)
    train, val = load_splits(DataConfig(**base))
    assert len(train) + len(val) == len(MATH_ROWS)
    train, val = load_splits(DataConfig(**base, max_examples=7))
    assert len(train) == 5 and len(val) == 2
    assert {e["question"] for e in train + val} <= {r["problem"] for r in MATH_ROWS[:7]}
    if name == "saved":
        train, val = load_splits(DataConfig(**{**base, "val_split": "test"}, max_examples=4))
        assert len(train) == 4 and len(val) == 3                    # the cap is on the train split only
    with pytest.raises(DataError, match="data.max_examples must be >= 0"):
        load_splits(DataConfig(**base, max_examples=-1))


def test_max_examples_streams_hub_ids(monkeypatch):
    import datasets
    calls = []

    class Stream:
        def take(self, n):
            return iter([{"problem": f"p{i}", "answer": str(i)} for i in range(n)])

    def fake_load(path, name=None, split=None, streaming=False, **kw):
        calls.append((path, name, split, streaming))
        return Stream()
    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    train, val = load_splits(DataConfig(source="hf", path="org/big-math", hf_config="main", max_examples=6, val_size=1))
    assert calls == [("org/big-math", "main", "train", True)] and len(train) == 5 and len(val) == 1


TINY = ["model.name_or_path=tiny", "model.dtype=float32", "model.gradient_checkpointing=false",
        "data.source=jsonl", "data.template=plain", "data.max_prompt_tokens=400", "rollout.engine=hf",
        "rollout.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=8", "rollout.max_model_len=0",
        "train.mini_batch_size=0", "train.micro_batch_size=4", "train.steps=1", "train.device=cpu",
        "train.val_every=1", "train.val_max_prompts=2", "train.save_final=false", "train.ckpt_every=0",
        "log.tensorboard=false", "log.dump_episodes_every=1", "fp8.cache_weights=false",
        "model.tiny.vocab=" + "".join(map(chr, range(32, 127))) + "\n"]  # real problems use all of ASCII


def _run(tmp_path, config, rows, *extra):
    train_p = _jsonl(tmp_path / "train.jsonl", rows[4:])
    val_p = _jsonl(tmp_path / "test.jsonl", rows[:4])
    p = subprocess.run([sys.executable, str(ROOT / "train_grpo.py"), "--config", str(ROOT / "configs" / config), *TINY,
                        f"data.path={train_p}", f"data.val_split={val_p}", f"train.out_dir={tmp_path}",
                        "train.run_name=r", *extra], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_run_warns_about_solution_answers(tmp_path):
    out = _run(tmp_path, "gsm8k.yaml", GSM8K_ROWS, "data.answer_regex=")
    assert "WARNING data: data.answer_field='answer': 16 of 16 gold answers look like worked solutions" in out
    assert "set data.answer_regex='#### (.*)'" in out


@pytest.mark.parametrize("config, rows", [("gsm8k.yaml", GSM8K_ROWS), ("math.yaml", MATH_ROWS)])
def test_config_runs_a_step_on_cpu(tmp_path, config, rows):
    assert "WARNING data" not in _run(tmp_path, config, rows)
    rec = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert rec[0]["step"] == 0 and "reward/mean" in rec[0] and "val/accuracy" in rec[0]
    episodes = [json.loads(line) for line in next((tmp_path / "r" / "episodes").glob("*.jsonl")).read_text().splitlines()]
    gold = ({r["answer"].split("#### ")[-1] for r in rows} if config == "gsm8k.yaml" else
            {r["solution"].split("\\boxed{")[-1][:-3] for r in rows})     # "...\boxed{3\sqrt{13}}$." -> 3\sqrt{13}
    assert episodes and {e["answer"] for e in episodes} <= gold
