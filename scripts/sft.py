"""Supervised warm start for the GPU quickstart and the convergence study: a small Llama that GRPO can improve.

    python -m scripts.sft --out /tmp/conv/sft_model                       # one H200, ~3 min
    python -m scripts.sft --out /tmp/sft --toy --minutes 0.2 --device cpu  # CPU smoke test
    python -m scripts.sft --warm-fp8                                      # fill Triton caches, exit

The model: a Llama built from config (default hidden 768, 12 layers, 6 heads of 128, 2 KV heads,
MLP 2048: ~76M parameters; every decoder linear is a multiple of 128 on both dims, so all of
them run block FP8 in trainer and vLLM) with the repo's char tokenizer (modeling.py). --arch picks
another family of models/; a mixture-of-experts one (qwen3_moe) replaces each MLP by --experts
experts of width --moe-intermediate, --experts-per-tok of them per token (the MoE quickstart,
configs/quickstart_moe_gpu.yaml).

The task is the GRPO task of --task-config (configs/ablations/base.yaml: synthetic difficulty 5,
three-term +-* expressions such as "(37*52)-18="). SFT trains on a mix of easier levels and
some level-5 problems (--mix), never on the GRPO validation questions nor on a dev set, with
worked solutions in the format the reward reads (for the synthetic task math_reward takes the last number):

    prompt    "(37*52)-18="                       exactly data.render_prompt (plain template)
    response  "37*52=37*50+37*2=1850+74=1924 1924-18=1906" + EOS

one step per operation in evaluation order, a two-digit multiplier split into tens and units,
a negative multiplicand written as -(...). GRPO gets room to improve because training stops
at the time budget (--minutes, cosine lr over that time) or as soon as greedy accuracy on the
dev set reaches --stop-acc, whichever comes first.

--guess F answers a share F of the task-level problems with a bare guess instead ("?1906" + EOS):
the warm start of the GPU quickstart (configs/quickstart_gpu.yaml). With F > 0.5 the model's
greedy answer to a task-level problem is a guess (mostly wrong) while its samples show their work
in a share 1 - F of the cases (mostly right), so GRPO has a fast, visible thing to learn: to work
the problem out. --max-steps then makes the run length (and the cosine) step-based, host-independent.

Training: fp32 master weights, bf16 autocast on CUDA, AdamW, linear warm-up then cosine decay
over the time budget, right-padded batches, loss on response tokens only. At the end: greedy
accuracy on the first train.val_max_prompts GRPO validation problems (what GRPO's step-0
val/accuracy should reproduce), and on the validation sets GRPO would use at each level of the
mix (also never trained on), written with the loss history to <out>/sft_metrics.json.

--warm-fp8: build the same-shaped model, convert it as the trainer does (run_setup.fp8_model) and
run forward/backward passes, so that torchao's Triton kernels are compiled and autotuned into
Triton's disk cache (fp8.torchao.keep_triton_autotuning). scripts/convergence.sh runs it next to the
SFT so the FP8 GRPO runs skip the ~100 s first-step autotune.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import re
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from config import FP8Config, TinyModelConfig, load_config
from data import load_splits, render_prompt, reward_last_number, synthetic_arithmetic
from modeling import build_char_tokenizer, build_tiny_model, save_model_dir
from models import FAMILIES
from rewards import math_reward

ROOT = Path(__file__).resolve().parents[1]
TOY = dict(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=64)

# ----------------------------------------------------------------------------- worked solutions

_PAREN = re.compile(r"\((\d+)([-+*])(\d+)\)([-+*])(\d+)=")
_FLAT = re.compile(r"(\d+)([-+*])(\d+)(?:([-+*])(\d+))?=")
_OPS = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}
GUESS = "?"  # an answer-only response: "?1906" (a bare guess; math_reward reads its number)


def _step(x: int, op: str, y: int) -> tuple[str, int]:
    """One operation as text, and its value. x*y with |x| >= 10 and y in [10, 99] is split:
    37*52=37*50+37*2=1850+74=1924; a negative x: -22*12=-(22*10+22*2)=-(220+44)=-264."""
    z = _OPS[op](x, y)
    if op != "*" or abs(x) < 10 or y < 10 or y % 10 == 0:
        return f"{x}{op}{y}={z}", z
    assert y < 100, y  # right operands of * are raw numbers in [0, 99]
    a, t, u = abs(x), y - y % 10, y % 10
    work = f"{a}*{t}+{a}*{u}", f"{a * t}+{a * u}"
    if x < 0:
        return f"{x}*{y}=-({work[0]})=-({work[1]})={z}", z
    return f"{x}*{y}={work[0]}={work[1]}={z}", z


def worked_solution(question: str) -> tuple[str, int]:
    """(response text, value) for a synthetic question of any difficulty (data._arith_example):
    'a op b=', '(a o1 b) o2 c=', or 'a o1 b o2 c=' with * before +- and left to right otherwise."""
    if m := _PAREN.fullmatch(question):
        a, o1, b, o2, c = m.groups()
        plan = [(int(a), o1, int(b)), (None, o2, int(c))]
    elif m := _FLAT.fullmatch(question):
        a, o1, b, o2, c = m.groups()
        if o2 is None:
            plan = [(int(a), o1, int(b))]
        elif o2 == "*" and o1 != "*":  # a + b*c
            s1, v1 = _step(int(b), "*", int(c))
            s2, v2 = _step(int(a), o1, v1)
            return f"{s1} {s2}", v2
        else:
            plan = [(int(a), o1, int(b)), (None, o2, int(c))]
    else:
        raise ValueError(f"not a synthetic arithmetic question: {question!r}")
    steps, value = [], None
    for x, op, y in plan:
        text, value = _step(value if x is None else x, op, y)
        steps.append(text)
    return " ".join(steps), value


# ----------------------------------------------------------------------------- data

class CharCodec:
    """Fast char -> id for the char tokenizer (same ids as tokenizer(text), BOS prepended)."""

    def __init__(self, tokenizer):
        self.vocab = tokenizer.get_vocab()
        self.bos, self.eos, self.pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id

    def ids(self, text: str) -> list[int]:
        try:
            return [self.vocab[c] for c in text]
        except KeyError as e:
            raise SystemExit(f"error: character {e.args[0]!r} is not in the char vocab (model.tiny.vocab)") from None


def parse_mix(text: str) -> dict[int, float]:
    mix = {}
    for part in text.split(","):
        d, w = part.split(":")
        mix[int(d)] = float(w)
    if not mix or any(d not in range(1, 6) or w < 0 for d, w in mix.items()) or sum(mix.values()) <= 0:
        raise SystemExit(f"error: --mix {text!r}: want 'difficulty:weight,...' with difficulties 1..5")
    return mix


class SFTStream:
    """Endless seeded batches of (prompt_ids, response_ids) drawn from the difficulty mix, skipping
    excluded questions (GRPO validation + SFT dev)."""

    def __init__(self, mix: dict[int, float], exclude: set[str], tokenizer, data_cfg, seed: int,
                 guess: float = 0.0, guess_level: int = 0):
        self.mix, self.exclude, self.tokenizer, self.data_cfg = mix, exclude, tokenizer, data_cfg
        self.guess, self.guess_level = guess, guess_level
        self.codec = CharCodec(tokenizer)
        self.rng, self.seed, self.calls = random.Random(f"sft-{seed}"), seed, 0

    def example(self, question: str, guess: bool = False) -> tuple[list[int], list[int]]:
        prompt = render_prompt(question, self.tokenizer, self.data_cfg)
        work, value = worked_solution(question)
        response = f"{GUESS}{value}" if guess else work
        return [self.codec.bos] + self.codec.ids(prompt), self.codec.ids(response) + [self.codec.eos]

    def batch(self, n: int) -> list[tuple[list[int], list[int]]]:
        self.calls += 1
        levels = self.rng.choices(list(self.mix), weights=list(self.mix.values()), k=n)
        out = []
        for d in sorted(set(levels)):
            k = levels.count(d)
            # seeds far from the GRPO splits' (data.synthetic.seed and seed + 1)
            probs = synthetic_arithmetic(2 * k, d, seed=1_000_000 + self.seed * 100_003 + self.calls)
            out += [self.example(p["question"], d == self.guess_level and self.rng.random() < self.guess)
                    for p in probs if p["question"] not in self.exclude][:k]
        self.rng.shuffle(out)
        return out


def collate_sft(examples, pad: int):
    """Right-padded input_ids [B, L], attention_mask [B, L], labels [B, L] (-100 off the response)."""
    L = max(len(p) + len(r) for p, r in examples)
    input_ids = torch.full((len(examples), L), pad, dtype=torch.long)
    labels = torch.full((len(examples), L), -100, dtype=torch.long)
    attention_mask = torch.zeros(len(examples), L, dtype=torch.long)
    for i, (p, r) in enumerate(examples):
        input_ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        labels[i, len(p): len(p) + len(r)] = torch.tensor(r)
        attention_mask[i, : len(p) + len(r)] = 1
    return input_ids, attention_mask, labels


def response_loss(model, input_ids, attention_mask, labels):
    """Mean cross-entropy over response tokens (fp32 logits)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # [B, L, V]
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


@torch.no_grad()
def greedy_texts(model, codec: CharCodec, tokenizer, problems, data_cfg, max_new_tokens: int, device,
                 amp, batch_size: int = 256) -> list[str]:
    """Greedy (HF generate) completions of `problems` [{"question", ...}]."""
    was_training = model.training
    model.eval()
    texts = []
    for i in range(0, len(problems), batch_size):
        chunk = problems[i: i + batch_size]
        rows = [[codec.bos] + codec.ids(render_prompt(p["question"], tokenizer, data_cfg)) for p in chunk]
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), codec.pad, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for j, r in enumerate(rows):  # left padding
            input_ids[j, width - len(r):] = torch.tensor(r)
            attention_mask[j, width - len(r):] = 1
        with amp():
            out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                 max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=codec.eos,
                                 pad_token_id=codec.pad)
        texts += tokenizer.batch_decode(out[:, width:].tolist(), skip_special_tokens=True)
    model.train(was_training)
    return texts


def greedy_eval(model, codec, tokenizer, problems, data_cfg, max_new_tokens: int, device, amp) -> dict:
    """{"accuracy": greedy accuracy under math_reward, "guess_share": share of greedy answers that are
    bare guesses (start with GUESS)} over `problems` [{"question", "answer"}]."""
    texts = greedy_texts(model, codec, tokenizer, problems, data_cfg, max_new_tokens, device, amp)
    last = reward_last_number(data_cfg)
    right = sum(math_reward(t, p["answer"], last_number=last) for t, p in zip(texts, problems))
    n = max(len(problems), 1)
    return {"accuracy": right / n, "guess_share": sum(t.startswith(GUESS) for t in texts) / n}


def greedy_accuracy(model, codec, tokenizer, problems, data_cfg, max_new_tokens: int, device, amp) -> float:
    return greedy_eval(model, codec, tokenizer, problems, data_cfg, max_new_tokens, device, amp)["accuracy"]


# ----------------------------------------------------------------------------- model

def model_spec(args) -> TinyModelConfig:
    dims = dict(TOY) if args.toy else dict(hidden_size=args.hidden, intermediate_size=args.intermediate,
                                           num_layers=args.layers, num_heads=args.heads,
                                           num_kv_heads=args.kv_heads, head_dim=args.head_dim)
    if FAMILIES[args.arch].experts is not None:  # a MoE family: its experts replace the dense MLP
        dims.update(num_experts=args.experts, num_experts_per_tok=args.experts_per_tok,
                    moe_intermediate_size=128 if args.toy else args.moe_intermediate)
    return TinyModelConfig(arch=args.arch, **dims)


def build(args, device):
    spec = model_spec(args)
    tokenizer = build_char_tokenizer(spec.vocab)
    torch.manual_seed(args.seed)
    model = build_tiny_model(spec, tokenizer, torch.float32).to(device)
    model.config._attn_implementation = "sdpa"
    return model, tokenizer


def held_out_sets(data_cfg, levels, n: int) -> dict[int, list[dict]]:
    """{d: the first n validation problems train_grpo.py uses with data.synthetic.difficulty=d}."""
    out = {}
    for d in sorted(levels):
        cfg_d = dataclasses.replace(data_cfg, synthetic=dataclasses.replace(data_cfg.synthetic, difficulty=d))
        out[d] = load_splits(cfg_d)[1][:n]
    return out


def pick_device(name: str) -> torch.device:
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)


def amp_context(device):
    return lambda: torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else \
        torch.autocast("cpu", enabled=False)


# ----------------------------------------------------------------------------- SFT

def train(args) -> dict:
    t_start = time.perf_counter()
    device = pick_device(args.device)
    cfg = load_config(args.task_config, args.task_overrides)
    level = cfg.data.synthetic.difficulty
    # the GRPO validation set of the task level, and of every level in the mix (what GRPO would
    # validate on with data.synthetic.difficulty=d: convergence.sh falls back to a lower level
    # when the SFT model cannot do the task yet); none of them is ever trained on
    vals = held_out_sets(cfg.data, set(parse_mix(args.mix)) | {level}, cfg.train.val_max_prompts)
    val = vals[level]
    exclude = {p["question"] for v in vals.values() for p in v}
    dev, seen = [], set(exclude)
    for p in synthetic_arithmetic(20 * args.dev_size + 100, level, seed=999_983):
        if p["question"] not in seen and len(dev) < args.dev_size:
            seen.add(p["question"])
            dev.append(p)
    exclude |= {p["question"] for p in dev}

    model, tokenizer = build(args, device)
    codec = CharCodec(tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"sft: {n_params / 1e6:.1f}M params on {device}; GRPO task difficulty {level}: {len(val)} val, "
          f"{len(dev)} dev problems; mix {args.mix}", flush=True)
    stream = SFTStream(parse_mix(args.mix), exclude, tokenizer, cfg.data, args.seed, args.guess, level)
    amp = amp_context(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay,
                            **({"fused": True} if device.type == "cuda" else {}))
    budget_s = args.minutes * 60
    max_new = cfg.rollout.max_new_tokens
    history, evals, step, tokens, stop_reason = [], [], 0, 0, "time budget"
    t0 = last_eval = time.perf_counter()
    model.train()
    while True:
        elapsed = time.perf_counter() - t0
        if elapsed >= budget_s:
            break
        if args.max_steps and step >= args.max_steps:
            stop_reason = "max steps"
            break
        if time.perf_counter() - last_eval >= args.eval_every_s:
            ev = greedy_eval(model, codec, tokenizer, dev, cfg.data, max_new, device, amp)
            acc = ev["accuracy"]
            evals.append({"step": step, "elapsed_s": round(elapsed, 1), "dev_accuracy": acc,
                          "dev_guess_share": ev["guess_share"]})
            print(f"sft eval: step {step} {elapsed:.0f}s dev accuracy {acc:.3f} guesses {ev['guess_share']:.2f}",
                  flush=True)
            last_eval = time.perf_counter()
            if args.stop_acc and acc >= args.stop_acc:
                stop_reason = f"dev accuracy {acc:.3f} >= --stop-acc {args.stop_acc}"
                break
        # linear warm-up over steps, then cosine over --max-steps (else the time budget) to lr * min_lr_frac
        progress = min(step / args.max_steps if args.max_steps else elapsed / budget_s, 1.0)
        lr = args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress)))
        lr *= min(1.0, (step + 1) / args.warmup_steps)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = collate_sft(stream.batch(args.batch_size), codec.pad)
        tokens += int(batch[1].sum())  # on the CPU copy: no device sync per step
        input_ids, attention_mask, labels = (x.to(device, non_blocking=True) for x in batch)
        with amp():
            loss = response_loss(model, input_ids, attention_mask, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % args.log_every == 0 or step == 1:
            loss_v = float(loss.detach())
            history.append({"step": step, "elapsed_s": round(time.perf_counter() - t0, 1), "loss": loss_v, "lr": lr})
            print(f"sft: step {step} {time.perf_counter() - t0:.0f}s loss {loss_v:.4f} lr {lr:.2e} "
                  f"tok/s {tokens / (time.perf_counter() - t0):.0f}", flush=True)
    train_s = time.perf_counter() - t0
    final_loss = float(loss.detach()) if step else float("nan")
    print(f"sft: stopped after {step} steps, {train_s:.0f}s ({stop_reason}); final loss {final_loss:.4f}", flush=True)

    ev = {d: greedy_eval(model, codec, tokenizer, v, cfg.data, max_new, device, amp) for d, v in vals.items()}
    by_level = {str(d): e["accuracy"] for d, e in ev.items()}
    val_acc, val_guess = ev[level]["accuracy"], ev[level]["guess_share"]
    dev_acc = greedy_accuracy(model, codec, tokenizer, dev, cfg.data, max_new, device, amp)
    out = save_model_dir(model, tokenizer, args.out)
    result = {
        "model_dir": str(out), "params": n_params, "spec": vars(model_spec(args)), "device": str(device),
        "steps": step, "tokens": tokens, "train_s": round(train_s, 1), "total_s": round(time.perf_counter() - t_start, 1),
        "stop_reason": stop_reason, "final_loss": final_loss, "task_difficulty": level,
        "val_accuracy": val_acc, "val_guess_share": val_guess, "val_size": len(val), "dev_accuracy": dev_acc,
        "val_accuracy_by_difficulty": by_level, "evals": evals, "loss_history": history,
        "args": {k: v for k, v in vars(args).items()},
    }
    (out / "sft_metrics.json").write_text(json.dumps(result, indent=1))
    print(f"sft: greedy accuracy on the GRPO val set {val_acc:.3f} ({len(val)} problems, difficulty {level}; "
          f"{val_guess:.2f} of the answers bare guesses); "
          f"dev {dev_acc:.3f}; val accuracy by difficulty {by_level}; saved {out}", flush=True)
    return result


# ----------------------------------------------------------------------------- FP8 warm-up

def warm_fp8(args) -> None:
    """Compile + autotune torchao's block-FP8 kernels for this model's shapes (trainer code path:
    fp32 master weights, bf16 autocast, forward + backward + a no-grad forward)."""
    device = pick_device(args.device)
    from fp8.linear import use_torchao
    from run_setup import fp8_model
    if device.type != "cuda" or not use_torchao(FP8Config(train=True), device):
        print("warm-fp8: no SM90 GPU, nothing to warm", flush=True)
        return
    t0 = time.perf_counter()
    model, tokenizer = build(args, device)
    fp8_model(model, FP8Config(train=True))
    ids = torch.randint(3, len(tokenizer), (64, 100), device=device)
    for _ in range(2):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
        loss.backward()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            model(input_ids=ids[:, :37])
    torch.cuda.synchronize()
    print(f"warm-fp8: torchao kernels compiled and autotuned in {time.perf_counter() - t0:.0f}s", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="/tmp/conv/sft_model", help="HF model dir to write")
    p.add_argument("--task-config", default=str(ROOT / "configs/ablations/base.yaml"),
                   help="GRPO config whose data section defines the task and validation set")
    p.add_argument("--task-overrides", nargs="*", default=[], help="key=value overrides for --task-config")
    p.add_argument("--minutes", type=float, default=2.5, help="training time budget (cosine lr over it)")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0 = time only)")
    p.add_argument("--stop-acc", type=float, default=0.45, help="stop once greedy dev accuracy reaches this (0: never)")
    p.add_argument("--guess", type=float, default=0.0,
                   help="share of the task-level problems answered by a bare guess ('?1906') instead of worked steps")
    p.add_argument("--eval-every-s", type=float, default=15.0, help="dev evaluation interval (early stop)")
    p.add_argument("--dev-size", type=int, default=128)
    p.add_argument("--mix", default="2:0.05,3:0.2,4:0.35,5:0.4", help="difficulty:weight of the SFT problems")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--arch", default="llama", choices=sorted(FAMILIES), help="model family (models/)")
    p.add_argument("--experts", type=int, default=8, help="MoE family: experts per layer")
    p.add_argument("--experts-per-tok", type=int, default=2, help="MoE family: experts per token (the router's top-k)")
    p.add_argument("--moe-intermediate", type=int, default=512, help="MoE family: each expert's SwiGLU width")
    p.add_argument("--toy", action="store_true", help=f"tiny dims for CPU tests: {TOY}")
    p.add_argument("--warm-fp8", action="store_true", help="only compile/autotune the FP8 trainer kernels")
    args = p.parse_args(argv)
    if args.warm_fp8:
        return warm_fp8(args)
    return train(args)


if __name__ == "__main__":
    main()
