"""data.py and the rewards it resolves: math/format rewards, synthetic arithmetic, JSONL / local HF
datasets, templates, sampler."""

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest

import data
import rewards
from config import DataConfig, SyntheticConfig, TinyModelConfig
from data import (DataError, PromptSampler, filter_long_prompts, load_splits, render_prompt, synthetic_arithmetic,
                  uses_chat_template)
from errors import UserError
from rewards import extract_answer, format_reward, math_reward, reward_stats

HALF = ["1/2", "0.5", "\\frac{1}{2}"]


# ------------------------------------------------------------------------------------------ rewards

@pytest.mark.parametrize("gold", HALF)
@pytest.mark.parametrize("form", HALF + ["\\dfrac12", ".5"])
def test_equivalent_forms(gold, form):
    assert math_reward(f"So we get \\boxed{{{form}}}.", gold) == 1.0
    assert math_reward(f"Final answer: {form}", gold) == 1.0
    assert math_reward(f"Some work.\nThe answer is ${form}$.", gold) == 1.0


def test_answer_is_sentence_and_integers():
    assert math_reward("The answer is 0.5.", "1/2") == 1.0
    assert math_reward("The answer is: 12\n\nchecking: 13 - 1", "12") == 1.0
    assert math_reward("**Answer:** 7 apples", "7") == 1.0
    assert math_reward("\\boxed{42}", "42") == 1.0
    assert math_reward("\\boxed{-3}", "-3") == 1.0
    assert math_reward("\\boxed{1,000}", "1000") == 1.0
    assert math_reward("Answer: 1,000", "1,000") == 1.0
    assert math_reward("\\boxed{\\sqrt{8}}", "2\\sqrt{2}") == 1.0


def test_last_number_rule_is_opt_in():
    for text, gold in [("3+4=7", "7"), ("I think 5 then 7", "7"), ("so x = -3", "-3"), ("it is 3/4", "0.75")]:
        assert math_reward(text, gold) == 0.0                       # states no answer: off by default
        assert math_reward(text, gold, last_number=True) == 1.0
    assert math_reward("I think 5 then 7", "5", last_number=True) == 0.0
    assert math_reward("5-3=2", "2", last_number=True) == 1.0       # '-3' is subtraction here, not a negative number
    assert extract_answer("I think 5 then 7", last_number=True) == ("number", "7")
    assert extract_answer("I think 5 then 7") is None
    assert data.reward_last_number(DataConfig()) is True            # synthetic: worked solutions end in the answer
    assert data.reward_last_number(DataConfig(source="jsonl")) is False
    assert data.reward_last_number(DataConfig(source="synthetic", reward_last_number=False)) is False


def test_boxed_wins_and_last_boxed():
    assert math_reward("\\boxed{5} and later 7 and 9", "5") == 1.0
    assert math_reward("\\boxed{3}, no wait: \\boxed{5}", "5") == 1.0
    assert math_reward("\\boxed{3}, no wait: \\boxed{5}", "3") == 0.0
    assert math_reward("\\boxed{\\frac{1}{\\sqrt{4}}}", "1/2") == 1.0   # nested braces
    assert rewards.last_boxed("\\boxed{a{b}c} then \\boxed{") == "a{b}c"
    assert extract_answer("\\boxed{a{b}c} then \\boxed{") is None      # an answer left open: unfinished


def test_wrong_answers():
    assert math_reward("\\boxed{8}", "7") == 0.0
    assert math_reward("The answer is 0.51", "1/2") == 0.0
    assert math_reward("\\boxed{-7}", "7") == 0.0
    assert math_reward("no numbers at all", "7") == 0.0


@pytest.mark.parametrize("completion", ["", "}}}{{{\\boxed{", "\\boxed{", "\\boxed{}", "\\boxed{\\frac{", "answer:",
                                        "$$$\\\\}{", None, 12, ["x"], "1" * 100_000, "word " * 200_000 + "\\boxed{7"])
def test_malformed_never_raises(completion):
    r = math_reward(completion, "5")
    assert r == 0.0
    assert format_reward(completion) in (0.0, 1.0)


def test_malformed_gold():
    for gold in ["", "\\frac{", "}{", None]:
        assert math_reward("\\boxed{5}", gold) == 0.0


def test_worker_threads():
    cases = [("\\boxed{\\frac{1}{2}}", "0.5", 1.0), ("The answer is \\sqrt{9}", "3", 1.0), ("7", "7", 1.0),
             ("\\boxed{0.3}", "1/3", 0.0)] * 4
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda c: math_reward(c[0], c[1]), cases))
    assert got == [c[2] for c in cases]
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward("\\boxed{\\dfrac{3}{6}}", "0.5")))
    t.start()
    t.join()
    assert out == [1.0]


def test_error_counter(monkeypatch):
    from math_verify.errors import TimeoutException
    reward_stats()

    def boom(text):
        raise RuntimeError("sympy exploded")
    monkeypatch.setattr(rewards, "_mv_parse", boom)
    assert math_reward("\\boxed{\\frac{17}{19}}", "17/19") == 0.0

    def slow(text):
        raise TimeoutException("timed out")
    monkeypatch.setattr(rewards, "_mv_parse", slow)
    assert math_reward("\\boxed{\\frac{23}{29}}", "23/29") == 0.0
    stats = reward_stats()
    assert stats["reward/errors"] >= 2 and stats["reward/timeouts"] >= 1
    assert set(reward_stats().values()) == {0}


def test_risky_answers_skipped_in_threads():
    """Power towers etc. would pin sympy (and the GIL) for minutes where no signal timeout exists."""
    cases = [("\\boxed{10^{10^{10}}}", "5"), ("\\boxed{(x+1)^{1000}}", "x+1"), ("Answer: 9**9**9", "5"),
             ("\\boxed{100!!}", "5"), ("\\boxed{\\int_0^1 x^{13} dx}", "1/14")]
    reward_stats()
    out = []
    t = threading.Thread(target=lambda: out.extend(math_reward(c, g) for c, g in cases), daemon=True)
    t.start()
    t.join(10)
    assert out == [0.0] * len(cases)
    assert reward_stats()["reward/skipped"] == len(cases)
    # harmless look-alikes and golds of the same kind are still compared
    assert math_reward("\\boxed{(2^3)^2}", "64") == 1.0
    assert math_reward("\\boxed{2^{10}}", "1024") == 1.0
    assert math_reward("\\boxed{5!}", "120") == 1.0
    assert math_reward("\\boxed{2^{100}}", "2^{100}") == 1.0


def test_integer_fast_path_matches_math_verify():
    from math_verify import parse, verify
    for gold, pred in [("7", "7"), ("7", "007"), ("-3", "-3"), ("0", "-0"), ("12", "21"), ("-5", "5"),
                       ("1000000000000000000", "1000000000000000001"), ("123456789", "123456789")]:
        mv = verify(parse(f"\\boxed{{{gold}}}"), parse(f"\\boxed{{{pred}}}"))
        assert math_reward(f"\\boxed{{{pred}}}", gold) == float(mv), (gold, pred)


def test_format_reward():
    assert format_reward("blah \\boxed{3}") == 1.0
    assert format_reward("\\boxed{\\frac{1}{2}} trailing") == 1.0
    assert format_reward("The answer is 3") == 0.0
    assert format_reward("\\boxed{}") == 0.0
    assert format_reward("\\boxed{3") == 0.0


# ---------------------------------------------------------------------------------------- synthetic

def _eval(q: str) -> int:
    assert q.endswith("=") and set(q) <= set("0123456789+-*=()")
    return eval(q[:-1])  # noqa: S307 - digits and operators only (asserted above)


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4, 5])
def test_synthetic_correct_and_deterministic(difficulty):
    a = synthetic_arithmetic(300, difficulty, seed=3)
    assert a == synthetic_arithmetic(300, difficulty, seed=3)
    assert a != synthetic_arithmetic(300, difficulty, seed=4)
    vocab = set(TinyModelConfig().vocab)
    for ex in a:
        assert set(ex["question"]) <= vocab and set(ex["answer"]) <= vocab
        assert int(ex["answer"]) == _eval(ex["question"])


def test_synthetic_ranges():
    import re
    operands = lambda d: [int(x) for ex in synthetic_arithmetic(500, d, 0) for x in re.findall(r"\d+", ex["question"])]
    ops = lambda d: {c for ex in synthetic_arithmetic(500, d, 0) for c in ex["question"] if c in "+-*"}
    assert set(operands(1)) == set(range(5)) and ops(1) == {"+"}
    assert set(operands(2)) == set(range(10)) and ops(2) == {"+", "-"}
    assert min(operands(3)) >= 10 and max(operands(3)) <= 99 and ops(3) == {"+", "-"}
    assert max(operands(4)) <= 99 and ops(4) == {"+", "-", "*"}
    assert all(len(re.findall(r"\d+", ex["question"])) == 3 for ex in synthetic_arithmetic(100, 5, 0))
    for d in (1, 2, 3):
        assert all(int(ex["answer"]) >= 0 for ex in synthetic_arithmetic(500, d, 0))
    with pytest.raises(DataError, match="difficulty"):
        synthetic_arithmetic(3, 9, 0)


@pytest.mark.parametrize("difficulty", [1, 2, 3, 5])
def test_synthetic_splits_disjoint(difficulty):
    cfg = DataConfig(synthetic=SyntheticConfig(num_train=500, num_val=50, difficulty=difficulty, seed=1))
    train, val = load_splits(cfg)
    assert len(train) == 500 and 0 < len(val) <= 50
    vq = [ex["question"] for ex in val]
    assert len(set(vq)) == len(vq)
    assert not set(vq) & {ex["question"] for ex in train}
    assert load_splits(cfg) == (train, val)
    if difficulty >= 3:
        assert len(val) == 50


# --------------------------------------------------------------------------------------- jsonl / hf

def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


ROWS = [{"problem": f"What is {i}+{i}?", "answer": str(2 * i), "extra": i} for i in range(40)]


def test_jsonl_holdout(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", ROWS + ROWS[:5])  # duplicates are dropped
    cfg = DataConfig(source="jsonl", path=path, val_size=10, seed=7)
    train, val = load_splits(cfg)
    assert len(train) == 30 and len(val) == 10
    assert set(train[0]) == {"question", "answer"}
    assert not {e["question"] for e in train} & {e["question"] for e in val}
    assert all(e in [{"question": r["problem"], "answer": r["answer"]} for r in ROWS] for e in train + val)
    assert load_splits(cfg) == (train, val)
    assert load_splits(DataConfig(source="jsonl", path=path, val_size=10, seed=8))[1] != val


def test_jsonl_val_file_and_numbers(tmp_path):
    train_p = _write_jsonl(tmp_path / "t.jsonl", [{"q": "1+1?", "a": 2}, {"q": "2+2?", "a": 4.0}])
    val_p = _write_jsonl(tmp_path / "v.jsonl", [{"q": "3+3?", "a": "6"}])
    train, val = load_splits(DataConfig(source="jsonl", path=train_p, val_split=val_p,
                                        prompt_field="q", answer_field="a"))
    assert train == [{"question": "1+1?", "answer": "2"}, {"question": "2+2?", "answer": "4"}]
    assert val == [{"question": "3+3?", "answer": "6"}]
    with pytest.raises(DataError, match="val_split must be the path"):
        load_splits(DataConfig(source="jsonl", path=train_p, val_split="test", prompt_field="q", answer_field="a"))


def test_jsonl_errors(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(DataError, match=r"no field 'question' \(data.prompt_field\); fields: problem, answer, "
                                        r"extra; set data.prompt_field") as e:
        load_splits(DataConfig(source="jsonl", path=path, prompt_field="question"))
    assert "d.jsonl" in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, UserError)
    with pytest.raises(DataError, match="no field 'solution' .*set data.answer_field"):
        load_splits(DataConfig(source="jsonl", path=path, answer_field="solution"))
    with pytest.raises(DataError, match="nope.jsonl: JSONL file not found"):
        load_splits(DataConfig(source="jsonl", path=str(tmp_path / "nope.jsonl")))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="empty"):
        load_splits(DataConfig(source="jsonl", path=str(tmp_path / "empty.jsonl")))
    (tmp_path / "bad.jsonl").write_text('{"problem": "a", "answer": "1"}\n{oops\n')
    with pytest.raises(DataError, match="bad.jsonl line 2: invalid JSON"):
        load_splits(DataConfig(source="jsonl", path=str(tmp_path / "bad.jsonl")))
    with pytest.raises(DataError, match=r"val_size=40 must be in \[0, 40\)"):
        load_splits(DataConfig(source="jsonl", path=path, val_size=40))


def test_answer_regex_gsm8k_style(tmp_path):
    rows = [{"question": f"Q{i}", "answer": f"Work {i} + {i}.\n#### {2 * i}"} for i in range(5)]
    rows.append({"question": "Q-no-marker", "answer": "no marker here"})
    path = _write_jsonl(tmp_path / "gsm.jsonl", rows)
    cfg = DataConfig(source="jsonl", path=path, prompt_field="question", answer_field="answer",
                     answer_regex="#### (.*)", val_size=0)
    train, val = load_splits(cfg)
    assert val == [] and sorted(e["answer"] for e in train) == ["0", "2", "4", "6", "8"]
    with pytest.raises(DataError, match="data.answer_regex '@@ \\(\\.\\*\\)' matched none"):
        load_splits(DataConfig(**{**cfg.__dict__, "answer_regex": "@@ (.*)"}))
    with pytest.raises(DataError, match="invalid regex"):
        load_splits(DataConfig(**{**cfg.__dict__, "answer_regex": "(unclosed"}))


def test_nested_fields_dapo_layout(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"Solve {i}*2. Answer: $Answer"}],
             "reward_model": {"ground_truth": str(2 * i), "style": "rule"}} for i in range(6)]
    path = _write_jsonl(tmp_path / "dapo.jsonl", rows)
    cfg = DataConfig(source="jsonl", path=path, prompt_field="prompt", answer_field="reward_model.ground_truth",
                     val_size=2)
    train, val = load_splits(cfg)
    assert sorted(e["question"] for e in train + val) == sorted(f"Solve {i}*2. Answer: $Answer" for i in range(6))
    assert all(e["answer"] == str(2 * int(e["question"].split()[1][:-3])) for e in train + val)
    cfg.prompt_field = "prompt.0.content"
    assert len(load_splits(cfg)[0]) == 4
    cfg.answer_field = "reward_model.gt"
    with pytest.raises(DataError, match=r"no field 'reward_model.gt'.*reward_model.ground_truth"):
        load_splits(cfg)


@pytest.fixture(scope="module")
def saved_dataset(tmp_path_factory):
    import datasets
    root = tmp_path_factory.mktemp("hf")
    tr = datasets.Dataset.from_dict({"problem": [f"p{i}" for i in range(30)], "answer": [str(i) for i in range(30)],
                                     "meta": [{"k": i} for i in range(30)]})
    te = datasets.Dataset.from_dict({"problem": ["t0", "t1"], "answer": ["0", "1"], "meta": [{"k": 0}, {"k": 1}]})
    datasets.DatasetDict({"train": tr, "test": te}).save_to_disk(str(root / "dd"))
    tr.save_to_disk(str(root / "single"))
    tr.to_parquet(str(root / "train.parquet"))
    return root


def test_hf_saved_dataset_dict(saved_dataset):
    cfg = DataConfig(source="hf", path=str(saved_dataset / "dd"), val_split="test")
    train, val = load_splits(cfg)
    assert len(train) == 30 and val == [{"question": "t0", "answer": "0"}, {"question": "t1", "answer": "1"}]
    train, val = load_splits(DataConfig(source="hf", path=str(saved_dataset / "single"), val_size=5))
    assert len(train) == 25 and len(val) == 5
    with pytest.raises(DataError, match=r"no such split.*splits: train, test.*data.train_split"):
        load_splits(DataConfig(source="hf", path=str(saved_dataset / "dd"), val_split="validation"))
    with pytest.raises(DataError, match=r"no field 'question' .*fields: problem, answer, meta, meta.k; "
                                        r"set data.prompt_field"):
        load_splits(DataConfig(source="hf", path=str(saved_dataset / "dd"), prompt_field="question"))
    with pytest.raises(DataError, match="no such file or directory"):
        load_splits(DataConfig(source="hf", path=str(saved_dataset / "missing")))
    with pytest.raises(DataError, match="single saved Dataset .*set data.val_split=''"):
        load_splits(DataConfig(source="hf", path=str(saved_dataset / "single"), val_split="test"))


def test_hf_local_data_file(saved_dataset, tmp_path, monkeypatch):
    import datasets
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    train, val = load_splits(DataConfig(source="hf", path=str(saved_dataset / "train.parquet"), val_size=3))
    assert len(train) == 27 and len(val) == 3
    js = _write_jsonl(tmp_path / "x.jsonl", ROWS[:8])
    train, val = load_splits(DataConfig(source="hf", path=js, answer_field="answer", val_size=0))
    assert sorted(e["question"] for e in train) == sorted(r["problem"] for r in ROWS[:8])


# ----------------------------------------------------------------------------------------- templates

@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {c: i for i, c in enumerate(["<pad>", "<unk>"] + list("0123456789+-*=?() \n"))}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>")


CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_render_plain(tokenizer):
    assert render_prompt("3+4=", tokenizer, DataConfig()) == "3+4="         # auto, no chat template
    assert not uses_chat_template(tokenizer, DataConfig())
    cfg = DataConfig(template="plain", system_prompt="Be brief.", instruction="Put it in \\boxed{}.")
    assert render_prompt("What is 3+4?", tokenizer, cfg) == "Be brief.\nWhat is 3+4? Put it in \\boxed{}."
    with pytest.raises(DataError, match="no chat template; set data.template=plain"):
        render_prompt("3+4=", tokenizer, DataConfig(template="chat"))


def test_render_chat(tokenizer):
    import copy
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = CHAT
    cfg = DataConfig(template="auto", system_prompt="S", instruction="Box it.")
    assert render_prompt("Q?", tok, cfg) == "<|system|>S\n<|user|>Q? Box it.\n<|assistant|>"
    assert render_prompt("Q?", tok, DataConfig(template="chat")) == "<|user|>Q?\n<|assistant|>"
    assert render_prompt("Q?", tok, DataConfig(template="plain")) == "Q?"
    assert uses_chat_template(tok, DataConfig()) and not uses_chat_template(tok, DataConfig(template="plain"))


def test_filter_long_prompts(tokenizer):
    exs = [{"question": "1+1=", "answer": "2"}, {"question": "12345+67890=", "answer": "80235"}]
    kept, dropped = filter_long_prompts(exs, tokenizer, DataConfig(max_prompt_tokens=6))
    assert kept == [{"question": "1+1=", "answer": "2", "prompt": "1+1="}] and dropped == 1
    with pytest.raises(DataError, match="max_prompt_tokens"):
        filter_long_prompts(exs, tokenizer, DataConfig(max_prompt_tokens=2))


# ------------------------------------------------------------------------------------------ sampler

def test_sampler_epochs_and_resume():
    exs = [{"question": str(i), "answer": str(i)} for i in range(10)]
    s = PromptSampler(exs, batch_size=4, seed=3)
    first = [next(s) for _ in range(5)]                     # 20 = two full epochs
    assert all(len(b) == 4 for b in first)
    flat = [e["question"] for b in first for e in b]
    assert sorted(flat[:10]) == sorted(flat[10:]) == [str(i) for i in range(10)]
    assert flat[:10] != flat[10:]                           # a fresh shuffle per epoch
    assert s.epoch == 2 and s.position == 0

    s = PromptSampler(exs, batch_size=4, seed=3)
    next(s), next(s), next(s)                               # mid-epoch 1
    state = json.loads(json.dumps(s.state_dict()))          # survives a JSON round trip
    rest = [next(s) for _ in range(4)]
    r = PromptSampler(exs, batch_size=4, seed=99)
    r.load_state_dict(state)
    assert r.state_dict()["seed"] == 3 and [next(r) for _ in range(4)] == rest
    assert [e["question"] for b in first[3:] for e in b] == [e["question"] for b in rest[:2] for e in b]
    assert PromptSampler(exs, 4, seed=4).__next__() != PromptSampler(exs, 4, seed=3).__next__()
    with pytest.raises(DataError):
        PromptSampler([], 4)
