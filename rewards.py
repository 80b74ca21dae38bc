"""Math reward: which part of a completion is its answer, and when it equals the gold answer.

    r = math_reward(completion, gold)                            # 1.0 / 0.0, never raises
    r = math_reward(completion, gold, finish_reason=s.finish_reason, last_number=False)

The answer is taken by the first rule that applies, in this order:

0. Unfinished output scores 0: `finish_reason == "length"` (cut off at max_new_tokens; not in
   rule 4's lenient mode), an
   unclosed `\\boxed{`, or text that ends in an operator or an opening bracket (`36 + `,
   `= `, `\\frac`, `(`) -- the model had not finished writing its answer.
1. `\\boxed{...}`: the last complete, non-empty one (nested braces handled).
2. A final-answer statement, the last of: "answer is", "answer:", "final answer is / :",
   "**Final Answer**" + newline, "####" (GSM8K). What follows it is read as ONE expression:
   the content of a `$...$`, `$$...$$`, `\\(...\\)` or `\\[...\\]` block, else the plain text, up to
   the end of the expression: the end of the line, a sentence end (". ", ";", "!", "?"), a closing
   bracket that opens nothing, or the first space-separated English word ("42 since there are
   7 days" -> 42; "5 cm" -> 5; math words sqrt/pi/sin/cos/tan/log/ln/exp/infty continue it).
   An answer that hedges ("5 or 6", "5 and 6") scores 0. A statement with nothing after it
   ("so the answer is") scores 0; it never falls through to rules 3-4.
3. A completion that is one bare number and nothing else ("7", "-3", "1/2", "$\\frac{1}{2}$",
   "2\\sqrt{3}.") -- the synthetic task's answer format. Sums and equations ("3+4") do not count.
4. Off unless `last_number=True` (data.reward_last_number; on by default for data.source=
   synthetic, whose worked solutions end "...=1850+74=1924"): the last number in the text, or
   the whole `$...$` it sits in ("$\\frac{1}{2}$" is 1/2, not 2). Text that starts with a closing
   bracket, '=', or an operator other than '-' ("=1", ")1") states nothing. This lenient mode
   also scores output cut at max_new_tokens by its text (the text checks of rule 0 still apply):
   the synthetic configs leave room for the answer and EOS only, so an untrained model's "7 "
   would otherwise score 0 and its first steps would have no signal.

The extracted answer is parsed as `\\boxed{<answer>}` by math-verify (so `3\\sqrt{13}` stays one
expression, not "3") and compared with the gold answer, also parsed as `\\boxed{<gold>}`:
1/2 == 0.5 == \\frac{1}{2}; intervals, sets, matrices, complex numbers and multiple-choice
letters ("(B)" == "B" == "\\text{(B)}") by math-verify's rules. Units, percent and degrees:
text units are dropped ("5\\text{ cm}", "5 cm" and "5cm" == 5; "\\$18" == 18); "45%" and "45\\%"
equal both 45 and 0.45, but a bare 0.45 does not equal gold 45; "90°", "90^\\circ" and
"90 degrees" equal 90. Plain integers on both sides are compared directly (same verdict, faster).
docs/reward.md compares every rule with verl's math-verify reward, case by case.

math-verify's signal-based timeouts (2 s) work in the main thread only; elsewhere they are off, so
answers that could pin sympy for minutes (power towers, huge exponents, n!!, integrals) score 0.0
unparsed. Exceptions and timeouts score 0.0 and are counted: `reward_stats()` reads and resets.
"""

from __future__ import annotations

import functools
import re
import threading

_REWARD_TIMEOUT_S = 2          # math-verify parse/verify limit (main thread only; signal.alarm)
_MAX_ANSWER_CHARS = 1000       # longer extracted answers score 0 without being parsed
_stats_lock = threading.Lock()
_stats = {"reward/errors": 0, "reward/timeouts": 0, "reward/skipped": 0}
# Answers that can keep sympy busy for minutes (in a worker thread nothing interrupts it, and big-int
# arithmetic holds the GIL): power towers, 3+ digit exponents, n!!, 4+ digit n!, calculus. Such a
# prediction scores 0 unparsed unless the gold answer has the same kind of construct.
_RISKY = re.compile(r"(?:\^|\*\*)\s*\{?\s*[-+]?\d{3}|\^\s*\{[^{}]*(?:\^|\*\*)|(?:\^|\*\*)\s*\(?\s*\w+\s*(?:\^|\*\*)"
                    r"|!\s*!|\d{4}\s*!|\\(?:int|iint|oint|sum|prod|lim)(?![a-zA-Z])")

_BOXED_OR_BRACE = re.compile(r"\\boxed\s*\{|\{|\}")
_ANCHOR = re.compile(r"\bfinal\s+answer\b\s*(?:\*\*)?\s*(?::|\bis\b|\n)|\banswer\b\s*(?:\*\*)?\s*(?::|=|\bis\b)"
                     r"|####", re.IGNORECASE)
_NUMBER = re.compile(r"(?:(?<![\w)\]])-)?(?:\d+(?:,\d{3})*(?:\.\d+)?|\.\d+)(?:/\d+)?")
_INT = re.compile(r"[+-]?\d+")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
# Rule 3: one bare number: n, n.d, a/b, \frac{a}{b}, n\sqrt{m}, n\pi, with a sign.
_NUM = r"(?:\d+(?:,\d{3})*(?:\.\d+)?|\.\d+)"
_BARE = re.compile(rf"[+-]?(?:{_NUM}(?:/\d+)?|\\[dt]?frac\s*\{{\s*{_NUM}\s*\}}\s*\{{\s*{_NUM}\s*\}}"
                   rf"|{_NUM}?\s*\\sqrt\s*\{{\s*{_NUM}\s*\}}|{_NUM}?\s*\\pi)")
# Text that stops mid-expression: a binary operator, '=', an opening bracket, a bare command.
# A markdown rule ('---') or bold ('**') is not an operator.
_UNFINISHED_END = re.compile(r"(?:(?<![-*])[-*]|[+/=^_(\[{,\\]|\\(?:cdot|times|div|frac|dfrac|sqrt|left|boxed))\s*$")
_JUNK_START = re.compile(r"\s*[)\]}=+*/^_,]")     # rule 4: "=1", ")1" state nothing
_INLINE_MATH = re.compile(r"\$([^$\n]+)\$|\\\((.+?)\\\)")
_BOLD = re.compile(r"(?:^|(?<=\s))\*\*|\*\*(?=\s|$|[.,:;!?])")   # markdown bold, not 9**9
_WORD = re.compile(r"[A-Za-z]+")
_MATH_WORDS = {"sqrt", "pi", "sin", "cos", "tan", "cot", "sec", "csc", "log", "ln", "exp", "infty", "inf"}
_LEAD_WORDS = re.compile(r"^(?:(?:therefore|thus|hence|then|so|just|simply|exactly|equal\s+to|equals|option|choice)"
                         r"\b[\s,:]*)+", re.IGNORECASE)
_OPEN, _CLOSE = "([{", ")]}"


def _count(key: str) -> None:
    with _stats_lock:
        _stats[key] += 1
        if key == "reward/timeouts":
            _stats["reward/errors"] += 1


def reward_stats(reset: bool = True) -> dict[str, int]:
    """Counts since the last reset: "reward/errors" (exceptions and timeouts), "reward/timeouts",
    "reward/skipped" (risky predictions scored 0 without parsing, see _RISKY)."""
    with _stats_lock:
        out = dict(_stats)
        if reset:
            for k in _stats:
                _stats[k] = 0
    return out


def _boxed(text: str) -> tuple[str | None, bool]:
    """(content of the last complete, non-empty \\boxed{...} or None, whether a \\boxed{ is left open)."""
    if "\\boxed" not in text:
        return None, False
    stack: list[tuple[bool, int]] = []     # (is a \boxed{, index just after its "{")
    best: tuple[int, int] | None = None    # the boxed span that closes last
    for m in _BOXED_OR_BRACE.finditer(text):
        tok = m.group()
        if tok == "}":
            if stack:
                is_boxed, start = stack.pop()
                if is_boxed and text[start:m.start()].strip():
                    best = (start, m.start())
        else:
            stack.append((tok != "{", m.end()))
    return (text[best[0]:best[1]].strip() if best else None), any(b for b, _ in stack)


def last_boxed(text: str) -> str | None:
    """Content of the last complete, non-empty \\boxed{...} (nested braces handled), else None."""
    return _boxed(text)[0]


def _math_block(s: str) -> str | None:
    """Content of a $...$ / $$...$$ / \\(...\\) / \\[...\\] block that `s` starts with, else None
    ('$18 each' is money, not math: no closing '$' on the line)."""
    for op, cl in (("$$", "$$"), ("\\[", "\\]"), ("\\(", "\\)"), ("$", "$")):
        if s.startswith(op):
            m = re.compile(r"(?<!\\)" + re.escape(cl)).search(s, len(op))     # not an escaped \$
            if m and m.start() > len(op) and (op != "$" or "\n" not in s[1:m.start()]):
                return s[len(op):m.start()]
            return None
    return None


def _statement_answer(rest: str) -> str | None:
    """The one expression a final-answer statement states (rule 2), or None if it states none."""
    rest = _BOLD.sub("", rest[:4 * _MAX_ANSWER_CHARS])
    s = rest.lstrip(" \t\n:*")
    s = _LEAD_WORDS.sub("", s)
    block = _math_block(s)
    if block is not None:                              # one math block: scanned too ("$72 clips$")
        s = block.replace("\n", " ").strip()
    s = re.sub(r"^\\?\$(?=\s*[\d.])", "", s)          # money: "$18" -> "18"
    opened: list[tuple[str, int]] = []                # unclosed brackets: (char, index)
    i, end = 0, len(s)
    while i < len(s):
        c = s[i]
        if c == "\\":                                  # a command (\sqrt) or an escaped char (\%)
            m = _WORD.match(s, i + 1)
            i = m.end() if m else i + 2
            continue
        if c in _OPEN:
            opened.append((c, i))
        elif c in _CLOSE:
            if not opened:                             # closes nothing: "... is 5)" ends at 5
                end = i
                break
            opened.pop()
        elif not opened and (c in "\n;!?" or (c == "." and (i + 1 == len(s) or not s[i + 1].isdigit()))):
            end = i
            break
        elif c.isalpha():
            word = _WORD.match(s, i).group()
            glued = i > 0 and (s[i - 1].isalnum() or s[i - 1] in "}^_")   # "5cm", "2xy", "4pi"
            in_arg = any(b == "{" for b, _ in opened)                        # \text{ cm}
            if len(word) >= 2 and not glued and not in_arg and word.lower() not in _MATH_WORDS:
                tail = s[i + len(word):].lstrip()
                if word.lower() == "or":
                    return None                        # a hedge: "5 or 6"
                if word.lower() == "and" and tail[:1] and (tail[0].isdigit() or tail[0] in "$\\(-"):
                    i += len(word)                     # a list: "1, 2 and 3" is read as "1, 2, 3"
                    continue
                end = opened[0][1] if opened else i    # "12 (dozen eggs)" -> "12"
                break
            i += len(word)
            continue
        i += 1
    ans = re.sub(r",?\s+and\s+", ", ", s[:end]).strip().rstrip(".,:;").strip()
    ans = re.sub(r"\$\s*$", "", ans).strip()
    if not ans or _UNFINISHED_END.search(ans):
        return None
    return re.sub(r"(?<!\\)%", r"\\%", ans)            # '%' starts a LaTeX comment


def extract_answer(completion: str, last_number: bool = False) -> tuple[str, str] | None:
    """(kind, text) of the completion's final answer by the module docstring's rules, kind in
    {"boxed", "statement", "bare", "number"}; None when it states none or is unfinished."""
    boxed, open_box = _boxed(completion)
    if open_box or _UNFINISHED_END.search(completion):
        return None
    if boxed is not None:
        return "boxed", boxed
    anchor = None
    for anchor in _ANCHOR.finditer(completion):
        pass
    if anchor is not None:
        ans = _statement_answer(completion[anchor.end():])
        return ("statement", ans) if ans is not None else None
    bare = completion.strip().rstrip(".").strip()
    inner = _math_block(bare)
    bare = (inner if inner is not None else bare).strip()
    if _BARE.fullmatch(bare):
        return "bare", bare
    if last_number and not _JUNK_START.match(completion):
        number = None
        for number in _NUMBER.finditer(completion):
            pass
        if number is not None:
            for block in _INLINE_MATH.finditer(completion):   # "$\frac{1}{2}$" is 1/2, not 2
                if block.start() < number.start() < block.end():
                    return "number", block.group(1) or block.group(2)
            return "number", number.group()
    return None


def _normalize(s: str) -> str:
    """Thousands separators out of plain numbers; '°' as LaTeX degrees."""
    s = s.strip().rstrip(".").strip().replace("°", "^\\circ")
    return s.replace(",", "") if _THOUSANDS.fullmatch(s) else s


def _mv_timeout() -> int | None:
    return _REWARD_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _mv_parse(text: str) -> tuple:
    """math_verify.parse that raises on internal errors/timeouts (counted by the caller)."""
    from math_verify import parse
    return tuple(parse(text, parsing_timeout=_mv_timeout(), raise_on_error=True))


@functools.lru_cache(maxsize=16384)
def _parse_gold(answer: str) -> tuple:
    parsed = _mv_parse("\\boxed{" + answer + "}")
    return parsed or _mv_parse(answer) or (answer.strip(),)


@functools.lru_cache(maxsize=16384)
def _parse_pred(text: str) -> tuple:
    return _mv_parse("\\boxed{" + text + "}")


def _call(fn, *args):
    """fn(*args); exceptions and math-verify timeouts are counted and give None."""
    from math_verify.errors import TimeoutException
    try:
        return fn(*args)
    except TimeoutException:
        _count("reward/timeouts")
    except Exception:  # noqa: BLE001 - a reward must never take the run down
        _count("reward/errors")
    return None


def math_reward(completion: str, answer: str, *, finish_reason: str | None = None,
                last_number: bool = False) -> float:
    """1.0 if the completion's final answer (module docstring: rules 0-4) equals `answer` per
    math-verify, else 0.0. finish_reason: the engine's ("stop" | "length" | None = unknown);
    last_number: rule 4's lenient mode on (the synthetic task). Never raises."""
    if not isinstance(completion, str) or not isinstance(answer, str) or not answer.strip():
        return 0.0
    if finish_reason == "length" and not last_number:
        return 0.0
    extracted = _call(extract_answer, completion, bool(last_number))
    if extracted is None or len(extracted[1]) > _MAX_ANSWER_CHARS:
        return 0.0
    kind, pred = extracted
    gold_n, pred_n = _normalize(answer), _normalize(pred)
    if _INT.fullmatch(gold_n) and _INT.fullmatch(pred_n):   # fast path: same verdict as math-verify
        return float(int(gold_n) == int(pred_n))
    if kind != "boxed":       # boxed text goes to math-verify as written
        pred = pred_n
    if _RISKY.search(pred) and not _RISKY.search(gold_n):
        _count("reward/skipped")
        return 0.0
    gold_p = _call(_parse_gold, gold_n)
    pred_p = _call(_parse_pred, pred)
    if not gold_p or not pred_p:
        return 0.0
    from math_verify import verify
    timeout = _mv_timeout()
    for g in gold_p:          # verify() on the lists, pair by pair so that failures are counted
        for p in pred_p:
            if _call(lambda: verify(g, p, timeout_seconds=timeout, raise_on_error=True)):
                return 1.0
    return 0.0


def format_reward(completion: str) -> float:
    """1.0 if the completion states an answer in a complete, non-empty \\boxed{...}, else 0.0."""
    try:
        return float(isinstance(completion, str) and last_boxed(completion) is not None)
    except Exception:  # noqa: BLE001
        return 0.0


# ----------------------------------------------------------------------------- the registry

def boxed_reward(completion: str, answer: str, *, finish_reason: str | None = None, last_number: bool = False) -> float:
    """format_reward as a registry entry: 1.0 for a complete, non-empty \\boxed{...}, whatever it holds."""
    return format_reward(completion)


REWARDS = {"math": math_reward, "format": boxed_reward}
"""The rewards `data.reward` chooses from, by name. Each is fn(completion, answer, *, finish_reason,
last_number) -> float in [0, 1] and never raises; the chosen one is the step's reward (plus
data.format_reward * format_reward), reward/accuracy and val/accuracy. Add a reward: add an entry."""
