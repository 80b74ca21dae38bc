"""rewards.py on real answer formats (MATH / GSM8K styles), side by side with verl's math-verify reward.

    python tests/unit/test_reward.py        # prints the per-category table that docs/reward.md quotes

Each gold answer comes with equivalent forms (scored right) and near misses (scored wrong); each is
written into completions the way models write them: boxed, unboxed final-answer statements, and
wrong or unfinished texts whose last number is the gold answer. verl_score is verl's
`verl/utils/reward_score/math_verify.py` compute_score: math-verify's math_metric with the gold
wrapped in \\boxed{} (LaTeX extraction) and the whole completion as prediction (expression + LaTeX
extraction).
"""

import re
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # `python tests/unit/test_reward.py` from anywhere
from rewards import math_reward  # noqa: E402

# (gold, equivalent forms a model may write, near misses)
MATH_GOLDS = [
    ("\\frac{5}{9}", ["\\frac{5}{9}", "\\frac 59", "5/9", "\\dfrac{5}{9}"], ["\\frac{9}{5}", "\\frac{5}{8}", "5", "9"]),
    ("3\\sqrt{13}", ["3\\sqrt{13}", "\\sqrt{117}"], ["3", "13", "\\sqrt{13}", "3\\sqrt{3}"]),
    ("6 - 5i", ["6 - 5i", "6-5i"], ["5", "6", "6 + 5i", "-5i"]),
    ("(-\\infty, 0]", ["(-\\infty, 0]", "(-\\infty,0]"], ["0", "(-\\infty, 0)", "[0, \\infty)"]),
    ("[-2, 5)", ["[-2, 5)", "[-2,5)"], ["[-2, 5]", "5", "(-2, 5)"]),
    ("\\begin{pmatrix} 1 \\\\ -2 \\end{pmatrix}", ["\\begin{pmatrix} 1 \\\\ -2 \\end{pmatrix}"],
     ["\\begin{pmatrix} -2 \\\\ 1 \\end{pmatrix}", "1", "-2"]),
    ("\\text{(B)}", ["(B)", "B", "\\text{(B)}"], ["(C)", "A", "\\text{(D)}"]),
    ("2\\pi", ["2\\pi", "2 \\pi"], ["2", "\\pi", "4\\pi"]),
    ("x^2 + 7x + 10", ["x^2 + 7x + 10", "x^2+7x+10"], ["x^2 + 7x", "10", "x^2 + 7x + 12"]),
    ("\\frac{\\sqrt{3}}{2}", ["\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}"], ["\\frac{1}{2}", "\\sqrt{3}", "2"]),
    ("-\\frac{1}{3}", ["-\\frac{1}{3}", "-1/3"], ["\\frac{1}{3}", "3", "-3"]),
    ("0.25", ["0.25", "\\frac{1}{4}", ".25"], ["0.52", "25", "0.2"]),
    ("1, 3", ["1, 3", "3, 1"], ["1", "3", "1, 2"]),
    ("90^\\circ", ["90^\\circ", "90"], ["45^\\circ", "180"]),
    ("45\\%", ["45\\%", "45"], ["55\\%", "4.5"]),
    ("\\sqrt{2}", ["\\sqrt{2}", "\\sqrt 2"], ["2", "\\sqrt{3}", "2\\sqrt{2}"]),
    ("\\dfrac{14}{3}", ["\\frac{14}{3}", "14/3"], ["14", "3", "\\frac{3}{14}"]),
    ("-\\sqrt{3}", ["-\\sqrt{3}"], ["\\sqrt{3}", "3", "-3"]),
    ("\\text{Devon}", ["\\text{Devon}"], ["\\text{Alex}"]),
    ("y = 2x + 3", ["y = 2x + 3", "y=2x+3"], ["y = 2x - 3", "y = 3x + 2"]),
    ("1024", ["1024", "2^{10}", "1,024"], ["1023", "10", "2^{9}"]),
    ("4", ["4", "4.0"], ["14", "-4", "\\frac{1}{4}"]),
]
# GSM8K golds are integers; models write them with units, currency and thousands separators
GSM8K_GOLDS = [
    ("72", ["72", "72 clips"], ["70", "7", "27"]),
    ("18", ["\\$18", "18 dollars"], ["\\$20", "8"]),
    ("1000", ["1,000", "1000"], ["100", "10000"]),
    ("5", ["5 hours"], ["6", "15"]),
    ("-3", ["-3"], ["3", "-13"]),
    ("36", ["36"], ["35", "63", "6"]),
]
GOLDS = MATH_GOLDS + GSM8K_GOLDS

WORK = "Let's compute step by step. We simplify the expression and check the cases.\n"
STATEMENTS = [  # unboxed final-answer statements, as models write them
    WORK + "The answer is {a}.",
    WORK + "The answer is ${a}$.",
    WORK + "Answer: {a}",
    WORK + "**Answer:** {a}",
    WORK + "Final Answer: The final answer is ${a}$. I hope it is correct.",
    WORK + "So the answer is {a} since every case checks out.",
    WORK + "Therefore, the final answer is: ${a}$",
]
BOXED = [WORK + "So the answer is $\\boxed{{{a}}}$.", WORK + "\\[\n\\boxed{{{a}}}\n\\]"]
# wrong answers whose text ends in the gold's number, and unfinished outputs (with gold g)
ENDS_IN_GOLD = ["So the answer is {g}\\sqrt{{2}}.", "So the answer is {g}\\pi.", "So the answer is x^2 + {g}.",
                "The answer is \\frac{{1}}{{{g}}}.", "The answer is 2^{{{g}}}.", "The answer is -{g}0."]
UNFINISHED = ["We get {g}, then {g} + ", "We get {g}. So the answer is", "Thus $\\boxed{{{g}",
              "So x = {g} and y =", "The total is {g} \\cdot", "Adding, {g} + 1 - 1 = \\frac"]


def verl_score(completion: str, gold: str) -> float:
    """verl's math_verify.compute_score (same calls, same extraction targets)."""
    from math_verify.metric import math_metric
    from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig
    verify_func = math_metric(gold_extraction_target=(LatexExtractionConfig(),),
                              pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()))
    try:
        return float(verify_func(["\\boxed{" + gold + "}"], [completion])[0])
    except Exception:  # noqa: BLE001 - verl scores exceptions 0 too
        return 0.0


def cases() -> dict[str, list[tuple[str, str, str | None, float]]]:
    """Category -> [(completion, gold, finish_reason, expected reward)]."""
    out = {"boxed right": [], "boxed wrong": [], "statement right": [], "statement wrong": [],
           "wrong, ends in gold number": [], "unfinished": [], "truncated (finish_reason=length)": []}
    for gold, rights, wrongs in GOLDS:
        for a in rights:
            if not re.search(r"\b[a-z]{3,}", re.sub(r"\\\w+", "", a)):   # no one boxes "72 clips"
                out["boxed right"] += [(t.format(a=a), gold, "stop", 1.0) for t in BOXED]
            out["statement right"] += [(t.format(a=a), gold, "stop", 1.0) for t in STATEMENTS]
            out["truncated (finish_reason=length)"].append((STATEMENTS[0].format(a=a), gold, "length", 0.0))
        for a in wrongs:
            out["boxed wrong"] += [(t.format(a=a), gold, "stop", 0.0) for t in BOXED]
            out["statement wrong"] += [(t.format(a=a), gold, "stop", 0.0) for t in STATEMENTS]
    for gold in [g for g, *_ in GSM8K_GOLDS if not g.startswith("-")] + ["7", "12", "2"]:
        out["wrong, ends in gold number"] += [(WORK + t.format(g=gold), gold, "stop", 0.0) for t in ENDS_IN_GOLD]
        out["unfinished"] += [(WORK + t.format(g=gold), gold, None, 0.0) for t in UNFINISHED]
    out["statement right"] += [(WORK + f"#### {g}", g, "stop", 1.0) for g, *_ in GSM8K_GOLDS]
    return out


def table() -> list[tuple[str, int, float, float]]:
    """(category, cases, share math_reward scores 1, share verl scores 1)."""
    rows = []
    for name, cs in cases().items():
        ours = sum(math_reward(c, g, finish_reason=f) for c, g, f, _ in cs) / len(cs)
        verl = sum(verl_score(c, g) for c, g, _, _ in cs) / len(cs)
        rows.append((name, len(cs), ours, verl))
    return rows


# ---------------------------------------------------------------------------------------------- tests

def test_real_format_table():
    cs = cases()
    assert sum(len(v) for v in cs.values()) >= 500
    right = cs["statement right"]
    missed = [(c, g) for c, g, f, _ in right if math_reward(c, g, finish_reason=f) != 1.0]
    assert len(missed) <= 0.01 * len(right), missed[:5]
    for name in ("statement wrong", "wrong, ends in gold number", "unfinished", "truncated (finish_reason=length)",
                 "boxed wrong"):
        scored = [(c, g) for c, g, f, _ in cs[name] if math_reward(c, g, finish_reason=f) != 0.0]
        assert not scored, (name, scored[:5])
    for c, g, f, want in cs["boxed right"]:
        assert math_reward(c, g, finish_reason=f) == want, (c, g)


def test_boxed_agrees_with_verl():
    cs = cases()
    for c, g, f, _ in cs["boxed right"] + cs["boxed wrong"]:
        assert math_reward(c, g, finish_reason=f) == verl_score(c, g), (c, g)


@pytest.mark.parametrize("completion, gold, want", [
    # 1. an unboxed LaTeX answer is one expression, not its first number (verl: 3, 5, 59, 0)
    ("The answer is 3\\sqrt{13}.", "3\\sqrt{13}", 1.0), ("The answer is 3\\sqrt{13}.", "3", 0.0),
    ("Answer: 6 - 5i", "6-5i", 1.0), ("Answer: 6 - 5i", "5", 0.0),
    ("Answer: \\frac 59", "\\frac{5}{9}", 1.0), ("Answer: \\frac 59", "59", 0.0),
    ("The answer is (-\\infty, 0].", "(-\\infty, 0]", 1.0), ("The answer is (-\\infty, 0].", "0", 0.0),
    ("So the answer is 4\\sqrt{2}.", "4", 0.0), ("So the answer is 4\\pi.", "4", 0.0),
    ("So the answer is x^2 + 4.", "4", 0.0),
    # 2. nothing rewarded from text that answers nothing
    ("We get 36, then 36 + ", "36", 0.0), ("so the answer is", "7", 0.0), ("\\boxed{3", "3", 0.0),
    ("=1", "1", 0.0), (")1", "1", 0.0), ("The answer is 5 or 6.", "5", 0.0),
    # 3. the expression ends where the answer does; LaTeX is not read digit by digit
    ("The answer is 42 since there are 7 days in a week.", "42", 1.0), ("$\\frac{1}{2}$", "1/2", 1.0),
    ("$\\frac{1}{2}$", "2", 0.0), ("The answer is $2^{10}$.", "1024", 1.0), ("The answer is $2^{10}$.", "10", 0.0),
    # units, percent, degrees, money, multiple choice, lists
    ("The answer is 5 cm.", "5", 1.0), ("The answer is 5\\text{ cm}^2.", "5", 1.0), ("The answer is 45%.", "45", 1.0),
    ("The answer is 45 percent.", "45\\%", 1.0), ("The answer is 90°.", "90", 1.0), ("The answer is 90 degrees.", "90", 1.0),
    ("The answer is $18.", "18", 1.0), ("The answer is \\$18.50 per day.", "18.5", 1.0),
    ("The answer is option (C).", "C", 1.0), ("The answer is (C).", "B", 0.0),
    ("The answer is 1, 2 and 3.", "1, 2, 3", 1.0), ("The answer is 1 and 2.", "1", 0.0),
    ("The answer is 12 (a dozen).", "12", 1.0), ("The answer is: **7**", "7", 1.0),
    # a bare number is an answer; an expression or equation on its own is not
    ("7", "7", 1.0), (" 7\n", "7", 1.0), ("-3", "-3", 1.0), ("3+4", "7", 0.0), ("3+4=7", "7", 0.0),
])
def test_listed_cases(completion, gold, want):
    assert math_reward(completion, gold) == want


def test_truncation_and_last_number_knob():
    assert math_reward("The answer is 7.", "7", finish_reason="length") == 0.0
    assert math_reward("\\boxed{7}", "7", finish_reason="length") == 0.0
    assert math_reward("\\boxed{7}", "7", finish_reason="stop") == 1.0
    assert math_reward("\\boxed{7} so 7 +", "7") == 0.0                  # trailing operator: unfinished
    assert math_reward("\\boxed{7}\n\n---", "7") == 1.0                  # a markdown rule is not an operator
    assert math_reward("I think it is 7", "7") == 0.0
    assert math_reward("I think it is 7", "7", last_number=True) == 1.0
    assert math_reward("I think it is 7 +", "7", last_number=True) == 0.0
    assert math_reward("7 ", "7", finish_reason="length") == 0.0
    assert math_reward("7 ", "7", finish_reason="length", last_number=True) == 1.0   # synthetic: no room past the answer
    assert math_reward("7=", "7", finish_reason="length", last_number=True) == 0.0
    assert math_reward("=7", "7", last_number=True) == 0.0
    assert math_reward("so we get $\\frac{1}{2}$", "2", last_number=True) == 0.0
    assert math_reward("so we get $\\frac{1}{2}$", "1/2", last_number=True) == 1.0


def test_threads_and_never_raises():
    cs = [c for v in cases().values() for c in v][::7]
    got = []
    t = threading.Thread(target=lambda: got.extend(math_reward(c, g, finish_reason=f) for c, g, f, _ in cs))
    t.start()
    t.join()
    assert got == [want for *_, want in cs]
    for bad in [("The answer is \\frac{", "1"), ("Answer: $$", "1"), ("The answer is \\", "1"), ("answer is )", "1")]:
        assert math_reward(*bad) == 0.0


if __name__ == "__main__":
    import logging
    logging.disable(logging.WARNING)          # math-verify logs every completion it cannot parse
    print("| category | cases | math_reward | verl math-verify |\n|---|---:|---:|---:|")
    for name, n, ours, verl in table():
        print(f"| {name} | {n} | {100 * ours:.1f}% | {100 * verl:.1f}% |")


def test_reward_registry_is_chosen_by_data_reward():
    """trainer.score scores with rewards.REWARDS[data.reward], plus data.format_reward x format_reward;
    `correct` is the chosen reward's verdict alone."""
    from types import SimpleNamespace

    import trainer
    from config import load_config
    from rewards import REWARDS
    from rollout import Sample

    texts = ["so \\boxed{4}", "answer: 5", "4", "\\boxed{5}"]

    class Tok:  # token id i decodes to texts[i]
        def batch_decode(self, ids, skip_special_tokens=True):
            return [texts[i[0]] for i in ids]

    samples = [Sample(0, [1], [i], [0.0], "stop") for i in range(4)]
    prompts = [{"answer": "4"}]
    for name, want in (("math", [1.0, 0.0, 1.0, 0.0]), ("format", [1.0, 0.0, 0.0, 1.0])):
        cfg = load_config(None, [f"data.reward={name}", "data.format_reward=0.5", "data.source=jsonl", "data.path=x"])
        got_texts, rewards, correct = trainer.score(SimpleNamespace(cfg=cfg, tokenizer=Tok()), prompts, samples)
        assert got_texts == texts and correct.tolist() == want
        assert rewards.tolist() == [c + 0.5 * b for c, b in zip(want, [1.0, 0.0, 0.0, 1.0])]
        assert [REWARDS[name](t, "4", finish_reason="stop", last_number=False) for t in texts] == want
    assert REWARDS["math"]("#### 4", "4") == math_reward("#### 4", "4") == 1.0  # the contract's entry point
