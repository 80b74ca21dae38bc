"""Prompts: synthetic arithmetic, JSONL / HF datasets, prompt templates; which reward rules apply.

    train, val = load_splits(cfg.data)                       # lists of {"question", "answer"}
    sampler = PromptSampler(train, cfg.rollout.prompts_per_step, seed=cfg.data.seed)
    batch = next(sampler)                                    # resumable: sampler.state_dict()
    prompt = render_prompt(batch[0]["question"], tokenizer, cfg.data)
    kept, n_dropped = filter_long_prompts(train, tokenizer, cfg.data)   # adds "prompt"
    for w in data_warnings(kept, n_dropped, cfg.data): print("WARNING", w)
    train, val = load_data(cfg, tokenizer, logger)           # all of the above, tokenized ("prompt_ids")

Sources (`data.source`):
  synthetic  seeded arithmetic ("3+4=" -> "7") that the char-level tiny tokenizer can spell;
             val questions never appear in train.
  jsonl      a local JSON-lines file; `val_split` may name a second file ('' = hold out).
  hf         a hub id (datasets.load_dataset(path, hf_config, split=...)), a directory written by
             Dataset/DatasetDict.save_to_disk, or a local .json/.jsonl/.parquet/.csv file.
Field names may be dotted paths into nested records (`reward_model.ground_truth`, `prompt.0.content`);
a field holding a chat message list ([{"role", "content"}, ...]) yields its last user message.
Rows with an empty question or answer (or an answer in which `answer_regex` / `answer_boxed` finds
nothing) are dropped and counted; duplicate questions are dropped (first kept) before the
validation hold-out.

Shipped configs for real math data: configs/gsm8k.yaml, configs/math.yaml (docs/models_data.md#real-math-data).
Example `data:` settings (field layouts from the dataset cards, not loaded here: no hub access):

  GSM8K        source: hf, path: openai/gsm8k, hf_config: main, val_split: test,
               prompt_field: question, answer_field: answer, answer_regex: '#### (.*)'
  MATH         source: hf, path: DigitalLearningGmbH/MATH-lighteval, val_split: test,
               prompt_field: problem, answer_field: solution, answer_boxed: true
               (columns problem/level/solution/type; the answer is the solution's last \\boxed{})
  MATH-500     source: hf, path: HuggingFaceH4/MATH-500, train_split: test, val_size: 100,
               prompt_field: problem, answer_field: answer        (500 problems, one split 'test';
               columns problem/solution/answer/subject/level/unique_id; an eval set, not for training)
  DAPO-Math    source: hf, path: BytedTsinghua-SIA/DAPO-Math-17k, prompt_field: prompt,
               answer_field: reward_model.ground_truth, template: chat
               (checked against the card's schema: prompt = [{"role": "user", "content": ...}],
               reward_model = {"ground_truth", "style"}, one split 'train' of ~1.79M rows that are
               ~17.4k problems repeated, hence the dedupe. The prompt text already asks for a last
               line "Answer: ...", which math_reward reads, so leave `instruction` empty.)
  OpenMath-2   source: hf, path: nvidia/OpenMathInstruct-2, train_split: train_1M,
               prompt_field: problem, answer_field: expected_answer, max_examples: 100000,
               instruction: 'Put your final answer within \\boxed{}.'
               (splits train_1M / train_2M / train_5M / train; believed layout, not verified here)

`data.max_examples` caps the train split (a hub id is then streamed: datasets' streaming + take);
otherwise `datasets` downloads and caches the split (HF_DATASETS_CACHE).

Reward: `math_reward` lives in rewards.py, whose docstring writes down its rules (boxed, then a
final-answer statement read as one expression, then a bare-number completion; nothing from
truncated output; the last-number fallback only with data.reward_last_number, which
`reward_last_number(cfg)` resolves: on for the synthetic task). docs/reward.md compares it with
verl's math-verify reward. `data_warnings` names overlong-prompt drops and gold answers that look
like worked solutions (GSM8K without data.answer_regex).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
from pathlib import Path
from typing import TYPE_CHECKING

from config import Config, DataConfig
from errors import UserError
from rewards import last_boxed

if TYPE_CHECKING:
    from observe import RunLogger

log = logging.getLogger(__name__)


class DataError(UserError):
    """Bad data source / fields / template; the message is one line that names the fix."""


# ----------------------------------------------------------------------------------------- rewards

def reward_last_number(cfg: DataConfig) -> bool:
    """data.reward_last_number resolved: None (auto) = on for the synthetic task, whose worked
    solutions end in their answer ('...=1850+74=1924'), off for real data (rewards.py, rule 4)."""
    return cfg.source == "synthetic" if cfg.reward_last_number is None else bool(cfg.reward_last_number)


# --------------------------------------------------------------------------------------- synthetic

def _arith_example(rng: random.Random, difficulty: int) -> dict:
    """1: a+b, a,b in [0,4]; 2: a+-b, a,b in [0,9]; 3: two-digit a+-b (results >= 0 up to here);
    4: a+-*b, a,b in [0,99]; 5: three terms in [0,99] with +-*, sometimes (a op b) op c."""
    ops = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}
    if difficulty <= 3:
        lo, hi = {1: (0, 4), 2: (0, 9), 3: (10, 99)}[difficulty]
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        op = "+" if difficulty == 1 else rng.choice("+-")
        if op == "-" and a < b:
            a, b = b, a
        return {"question": f"{a}{op}{b}=", "answer": str(ops[op](a, b))}
    if difficulty == 4:
        a, b, op = rng.randint(0, 99), rng.randint(0, 99), rng.choice("+-*")
        return {"question": f"{a}{op}{b}=", "answer": str(ops[op](a, b))}
    a, b, c = (rng.randint(0, 99) for _ in range(3))
    o1, o2 = rng.choice("+-*"), rng.choice("+-*")
    if rng.random() < 1 / 3:
        q, v = f"({a}{o1}{b}){o2}{c}=", ops[o2](ops[o1](a, b), c)
    elif o2 == "*" and o1 != "*":
        q, v = f"{a}{o1}{b}{o2}{c}=", ops[o1](a, b * c)
    else:
        q, v = f"{a}{o1}{b}{o2}{c}=", ops[o2](ops[o1](a, b), c)
    return {"question": q, "answer": str(v)}


def _check_difficulty(difficulty: int) -> None:
    if difficulty not in (1, 2, 3, 4, 5):
        raise DataError(f"data.synthetic.difficulty must be 1..5, got {difficulty}")


def synthetic_arithmetic(n: int, difficulty: int, seed: int) -> list[dict]:
    """n seeded arithmetic problems {"question": "3+4=", "answer": "7"} (may repeat: small spaces)."""
    _check_difficulty(difficulty)
    rng = random.Random(f"arith-{difficulty}-{seed}")
    return [_arith_example(rng, difficulty) for _ in range(n)]


_ARITH_SPACE = {1: 25, 2: 155, 3: 12195, 4: 30000}   # distinct questions per difficulty (5: ~10^7)


def _synthetic_splits(cfg: DataConfig) -> tuple[list[dict], list[dict]]:
    """Val: up to num_val distinct questions, at most a fifth of the question space (5 of the 25 at
    difficulty 1); train: num_train draws from a differently seeded stream, val questions skipped.
    With synthetic.disjoint_val=false, val may hold any question (the whole space if num_val
    allows) and train is not filtered: accuracy over the task, not held-out generalisation."""
    s = cfg.synthetic
    _check_difficulty(s.difficulty)
    if s.num_train < 1:
        raise DataError(f"data.synthetic.num_train must be >= 1, got {s.num_train}")
    space = _ARITH_SPACE.get(s.difficulty, 5 * s.num_val)
    n_val = min(s.num_val, space // 5 if s.disjoint_val else space)
    val, seen = [], set()
    val_rng = random.Random(f"arith-{s.difficulty}-{s.seed + 1}")
    for _ in range(100 * n_val + 1000):
        if len(val) >= n_val:
            break
        ex = _arith_example(val_rng, s.difficulty)
        if ex["question"] not in seen:
            seen.add(ex["question"])
            val.append(ex)
    rng = random.Random(f"arith-{s.difficulty}-{s.seed}")
    train = []
    while len(train) < s.num_train:
        ex = _arith_example(rng, s.difficulty)
        if ex["question"] not in seen or not s.disjoint_val:
            train.append(ex)
    return train, val


# ----------------------------------------------------------------------------------- file / hub

_MISSING = object()
_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def _looks_local(path: str) -> bool:
    return (os.path.exists(path) or path.startswith(("/", "./", "../", "~"))
            or Path(path).suffix.lower() in _FILE_BUILDERS)


def _read_jsonl(path: str, max_rows: int = 0) -> list[dict]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"data.path={path}: JSONL file not found (cwd {os.getcwd()}); fix data.path")
    rows = []
    with p.open(encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path} line {i}: invalid JSON ({e.msg}); each line must be one JSON object") from None
            if not isinstance(row, dict):
                raise DataError(f"{path} line {i}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
            if len(rows) == max_rows:
                break
    return rows


def _load_hf(path: str, hf_config: str, split: str, fields: list[str], is_val: bool = False,
             max_rows: int = 0) -> list[dict]:
    """Rows of a hub dataset, a save_to_disk directory or a local data file, with only the columns
    that `fields` (possibly dotted paths) need; a missing column returns the first full row so the
    caller can report which fields exist. max_rows > 0: the first max_rows rows only, streamed for
    a hub id (nothing else is downloaded); otherwise datasets downloads and caches the split."""
    import datasets
    local = Path(path).expanduser()
    what = f"data.path={path} (split {split!r})"
    if _looks_local(path) and not local.exists():
        raise DataError(f"data.path={path}: no such file or directory (cwd {os.getcwd()}); fix data.path")
    if max_rows and not local.exists():
        try:
            return list(datasets.load_dataset(path, hf_config or None, split=split, streaming=True).take(max_rows))
        except Exception as e:  # noqa: BLE001 - as below
            raise DataError(f"{what}, hf_config={hf_config!r}: could not stream dataset ({_first_line(e)}); "
                            "check data.path / data.hf_config / data.train_split") from None
    try:
        if local.is_dir() and ((local / "dataset_dict.json").exists() or (local / "state.json").exists()):
            ds = datasets.load_from_disk(str(local))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise DataError(f"{what}: no such split in this saved DatasetDict (splits: {', '.join(ds)}); "
                                    "set data.train_split / data.val_split")
                ds = ds[split]
            elif is_val:
                raise DataError(f"data.path={path} is a single saved Dataset (no splits), so data.val_split="
                                f"{split!r} names nothing; set data.val_split='' to hold out data.val_size examples")
        elif local.is_file():
            builder = _FILE_BUILDERS.get(local.suffix.lower())
            if builder is None:
                raise DataError(f"data.path={path}: unknown data file type (use one of {', '.join(_FILE_BUILDERS)})")
            ds = datasets.load_dataset(builder, data_files=str(local), split="train")
        else:  # hub id or a directory of data files
            ds = datasets.load_dataset(str(local) if local.is_dir() else path, hf_config or None, split=split)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets raises many types; the user needs one line
        raise DataError(f"{what}, hf_config={hf_config!r}: could not load dataset ({_first_line(e)}); "
                        "check data.path / data.hf_config / data.train_split / data.val_split") from None
    if len(ds) == 0:
        return []
    if max_rows:
        ds = ds.select(range(min(max_rows, len(ds))))
    cols = {f if f in ds.column_names else f.split(".")[0] for f in fields}
    if not cols <= set(ds.column_names):
        return [ds[0]]
    return ds.select_columns(sorted(cols)).to_list()


def _get(row, field: str):
    """row[field], or a dotted path through dicts / lists ('reward_model.ground_truth', 'prompt.0.content')."""
    if isinstance(row, dict) and field in row:
        return row[field]
    node = row
    for part in field.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, (list, tuple)) and part.lstrip("-").isdigit() and -len(node) <= int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


def _as_text(v) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() else str(v)
    if isinstance(v, (list, tuple)) and v and all(isinstance(m, dict) and "content" in m for m in v):
        users = [m for m in v if m.get("role", "user") == "user"] or list(v)   # chat messages
        return _as_text(users[-1]["content"])
    return None


def _fields_of(row: dict) -> str:
    names = []
    for k, v in row.items():
        names.append(k)
        if isinstance(v, dict):
            names += [f"{k}.{kk}" for kk in v]
    return ", ".join(names)


def _to_examples(rows: list[dict], cfg: DataConfig, name: str) -> list[dict]:
    if not rows:
        raise DataError(f"{name}: dataset is empty (0 rows); check data.path and the split")
    for key in ("prompt_field", "answer_field"):
        field = getattr(cfg, key)
        if _get(rows[0], field) is _MISSING:
            raise DataError(f"{name}: no field {field!r} (data.{key}); fields: {_fields_of(rows[0])}; "
                            f"set data.{key}")
    try:
        regex = re.compile(cfg.answer_regex) if cfg.answer_regex else None
    except re.error as e:
        raise DataError(f"data.answer_regex={cfg.answer_regex!r}: invalid regex ({e})") from None
    out, seen, dropped, no_match = [], set(), 0, 0
    for row in rows:
        q = _as_text(_get(row, cfg.prompt_field))
        a = _as_text(_get(row, cfg.answer_field))
        if a is not None and regex is not None:
            m = regex.search(a)
            a = (m.group(1) if m.re.groups else m.group(0)) if m else None
            no_match += m is None
        if a is not None and cfg.answer_boxed:
            a = last_boxed(a)
            no_match += a is None
        q, a = (q or "").strip(), (a or "").strip()
        if not q or not a:
            dropped += 1
        elif q not in seen:
            seen.add(q)
            out.append({"question": q, "answer": a})
    if not out:
        what = " / ".join(f"data.{k} {v!r}" for k, v in (("answer_regex", cfg.answer_regex),
                                                         ("answer_boxed", cfg.answer_boxed)) if v)
        why = (f"{what} matched none of the answers (e.g. {str(_get(rows[0], cfg.answer_field))[:80]!r}); "
               f"fix {what.split()[0]}") if no_match else \
              (f"every row has an empty or non-text {cfg.prompt_field!r} / {cfg.answer_field!r}; "
               "set data.prompt_field / data.answer_field")
        raise DataError(f"{name}: no usable examples in {len(rows)} rows: {why}")
    if dropped or len(out) + dropped < len(rows):
        log.warning("%s: %d rows -> %d examples (%d dropped: empty field or answer_regex / answer_boxed no match; "
                    "%d duplicate questions)", name, len(rows), len(out), dropped, len(rows) - dropped - len(out))
    return out


def _load_examples(cfg: DataConfig, split: str, is_val: bool) -> list[dict]:
    """Examples of one split. For local files (source=jsonl, or hf with a file path) the train split
    is data.path itself and data.val_split, when set, is the path of a second file."""
    fields = [cfg.prompt_field, cfg.answer_field]
    if cfg.source == "jsonl" or (cfg.source == "hf" and Path(cfg.path).suffix.lower() in _FILE_BUILDERS):
        path = split if is_val else cfg.path
        if is_val and not Path(path).expanduser().is_file():
            raise DataError(f"data.val_split={split!r}: with a local data file, val_split must be the path of "
                            "a validation file, or '' to hold out data.val_size examples")
        max_rows = 0 if is_val else cfg.max_examples
        rows = _read_jsonl(path, max_rows) if cfg.source == "jsonl" else _load_hf(path, "", "train", fields, max_rows=max_rows)
        return _to_examples(rows, cfg, f"data.path={path}" if not is_val else f"data.val_split={path}")
    return _to_examples(_load_hf(cfg.path, cfg.hf_config, split, fields, is_val, 0 if is_val else cfg.max_examples),
                        cfg, f"data.path={cfg.path} (split {split!r})")


def load_splits(cfg: DataConfig) -> tuple[list[dict], list[dict]]:
    """(train, val), each a list of {"question", "answer"} strings.

    val = data.val_split when set, else the last data.val_size examples of the train split after a
    shuffle seeded by data.seed (after the question dedupe, so no val question is in train).
    synthetic: data.synthetic.num_train / num_val / seed instead (val_size and seed unused)."""
    if cfg.source == "synthetic":
        return _synthetic_splits(cfg)
    if not cfg.path:
        raise DataError(f"data.path is required for data.source={cfg.source}")
    if cfg.max_examples < 0:
        raise DataError(f"data.max_examples must be >= 0 (0 = all rows), got {cfg.max_examples}")
    train = _load_examples(cfg, cfg.train_split, is_val=False)
    if cfg.val_split:
        return train, _load_examples(cfg, cfg.val_split, is_val=True)
    if cfg.val_size < 0 or cfg.val_size >= len(train):
        raise DataError(f"data.val_size={cfg.val_size} must be in [0, {len(train)}) for this train split of "
                        f"{len(train)} examples; lower data.val_size or set data.val_split")
    random.Random(cfg.seed).shuffle(train)
    cut = len(train) - cfg.val_size
    return train[:cut], train[cut:]


# -------------------------------------------------------------------------------------- templates

def _user_text(question: str, cfg: DataConfig) -> str:
    return question + (" " + cfg.instruction if cfg.instruction else "")


def uses_chat_template(tokenizer, cfg: DataConfig) -> bool:
    """Whether render_prompt applies the chat template: template=chat, or auto and the tokenizer has one.
    Chat templates write their own BOS, so tokenize such prompts with add_special_tokens=False."""
    return cfg.template == "chat" or (cfg.template == "auto" and bool(getattr(tokenizer, "chat_template", None)))


def render_prompt(question: str, tokenizer, cfg: DataConfig) -> str:
    """Prompt text for one question: the tokenizer's chat template ('chat'), or
    [system_prompt + newline] + question [+ space + instruction] ('plain'); 'auto' picks chat if it can."""
    if not uses_chat_template(tokenizer, cfg):
        return (cfg.system_prompt + "\n" if cfg.system_prompt else "") + _user_text(question, cfg)
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DataError(f"data.template=chat but tokenizer {name!r} has no chat template; "
                        "set data.template=plain (or auto)")
    messages = ([{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []) + \
               [{"role": "user", "content": _user_text(question, cfg)}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def filter_long_prompts(examples: list[dict], tokenizer, cfg: DataConfig,
                        batch_size: int = 1024) -> tuple[list[dict], int]:
    """Examples with "prompt" (rendered) added, dropping those over cfg.max_prompt_tokens tokens
    (special tokens counted only for plain prompts, see uses_chat_template). Returns (kept, n_dropped)."""
    kept, dropped = [], 0
    special = not uses_chat_template(tokenizer, cfg)
    for i in range(0, len(examples), batch_size):
        chunk = examples[i:i + batch_size]
        prompts = [render_prompt(ex["question"], tokenizer, cfg) for ex in chunk]
        ids = tokenizer(prompts, add_special_tokens=special)["input_ids"]
        for ex, p, t in zip(chunk, prompts, ids):
            if len(t) <= cfg.max_prompt_tokens:
                kept.append({**ex, "prompt": p})
            else:
                dropped += 1
    if examples and not kept:
        raise DataError(f"all {len(examples)} prompts are longer than data.max_prompt_tokens="
                        f"{cfg.max_prompt_tokens}; raise data.max_prompt_tokens")
    return kept, dropped


_WARN_SHARE = 0.10             # data_warnings fires above this share of the examples
_SENTENCE_END = re.compile(r"[.!?](?:\s|$)")


def looks_like_solution(answer: str) -> bool:
    """Whether a gold answer looks like a worked solution rather than a final answer: it holds a
    GSM8K '####' marker or a \\boxed{}, spans lines, or is long and has two or more sentences."""
    return ("####" in answer or "\\boxed" in answer or "\n" in answer.strip()
            or (len(answer) > 40 and len(_SENTENCE_END.findall(answer)) >= 2))


def data_warnings(examples: list[dict], n_dropped: int, cfg: DataConfig) -> list[str]:
    """One-line warnings (with the fix) about data that would train on the wrong thing: more than 10%
    of the prompts dropped as overlong (filter_long_prompts' count), or gold answers that look like
    worked solutions, which math_reward would compare with the model's final answer as a whole."""
    out = []
    total = len(examples) + n_dropped
    if total and n_dropped / total > _WARN_SHARE:
        out.append(f"{n_dropped} of {total} prompts ({100 * n_dropped / total:.1f}%) are longer than "
                   f"data.max_prompt_tokens={cfg.max_prompt_tokens} and were dropped; raise data.max_prompt_tokens "
                   "(and rollout.max_model_len) to train on them")
    answers = [ex["answer"] for ex in examples[:2000]]
    bad = [a for a in answers if looks_like_solution(a)]
    if answers and len(bad) / len(answers) > _WARN_SHARE:
        fix = ("set data.answer_regex='#### (.*)'" if any("####" in a for a in bad) else
               "set data.answer_boxed=true" if any("\\boxed" in a for a in bad) else
               "set data.answer_regex to extract the final answer, or data.answer_field to a field holding only it")
        out.append(f"data.answer_field={cfg.answer_field!r}: {len(bad)} of {len(answers)} gold answers look like "
                   f"worked solutions (e.g. {bad[0][:70]!r}); the reward compares the model's final answer with "
                   f"the whole field, so almost nothing scores; {fix}")
    return out


def prepare_prompts(examples, tokenizer, cfg: Config):
    """Render + tokenize; prompts longer than data.max_prompt_tokens are dropped (counted)."""
    kept, dropped = filter_long_prompts(examples, tokenizer, cfg.data)
    if cfg.model.name_or_path == "tiny":
        from modeling import check_char_vocab
        check_char_vocab(cfg.model.tiny.vocab, [ex["prompt"] for ex in kept])
    special = not uses_chat_template(tokenizer, cfg.data)  # chat templates write their own BOS
    ids = tokenizer([ex["prompt"] for ex in kept], add_special_tokens=special)["input_ids"] if kept else []
    return [{**ex, "prompt_ids": i} for ex, i in zip(kept, ids)], dropped


def load_data(cfg: Config, tokenizer, logger: RunLogger) -> tuple[list[dict], list[dict]]:
    """(train, val) prompts, tokenized; what was dropped or looks wrong is printed."""
    train_set, val_set = load_splits(cfg.data)
    train_set, dropped = prepare_prompts(train_set, tokenizer, cfg)
    val_set, _ = prepare_prompts(val_set, tokenizer, cfg)
    if cfg.train.val_every and not val_set:
        raise UserError("the validation split is empty; set data.val_size / data.val_split, or train.val_every=0")
    logger.print(f"data: {len(train_set)} train prompts ({dropped} dropped as overlong), {len(val_set)} val")
    for warning in data_warnings(train_set, dropped, cfg.data):
        logger.print(f"WARNING data: {warning}")
    return train_set, val_set


# ---------------------------------------------------------------------------------------- sampler

class PromptSampler:
    """Endless batches of `batch_size` examples over seeded shuffled epochs (a batch may straddle two
    epochs). state_dict() / load_state_dict() resume at the same data position."""

    def __init__(self, examples: list[dict], batch_size: int, seed: int = 0):
        if not examples:
            raise DataError("PromptSampler: no training examples")
        if batch_size < 1:
            raise DataError(f"PromptSampler: batch_size must be >= 1, got {batch_size}")
        self.examples, self.batch_size, self.seed = examples, batch_size, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(f"sampler-{self.seed}-{epoch}").shuffle(order)
        return order

    def __iter__(self) -> PromptSampler:
        return self

    def __next__(self) -> list[dict]:
        batch = []
        while len(batch) < self.batch_size:
            take = self._order[self.position:self.position + self.batch_size - len(batch)]
            batch += [self.examples[i] for i in take]
            self.position += len(take)
            if self.position >= len(self._order):       # roll over eagerly: state is (next epoch, 0)
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_examples": len(self.examples)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_examples", len(self.examples)) != len(self.examples):
            log.warning("PromptSampler: checkpoint was taken over %d examples, now %d: the data changed, "
                        "so the resumed order differs", state["num_examples"], len(self.examples))
        self.seed, self.epoch, self.position = int(state["seed"]), int(state["epoch"]), int(state["position"])
        if self.position >= len(self.examples):
            self.epoch, self.position = self.epoch + 1, 0
        self._order = self._permutation(self.epoch)
