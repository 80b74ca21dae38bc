"""Export a training checkpoint as a Hugging Face model dir that transformers and vLLM load.

    python export_hf.py runs/tiny_cpu-20261122-101500 out/tiny                # latest checkpoint
    python export_hf.py runs/tiny_cpu-20261122-101500/checkpoints/step_000080 out/tiny-fp8 --fp8
    VLLM_USE_DEEP_GEMM_E8M0=0 vllm serve out/tiny-fp8 [--kv-cache-dtype fp8]  # (scales inside: see below)

Plain: the trainer's master weights (in their dtype, or --dtype) as safetensors, with
config.json, generation_config.json and the tokenizer. transformers' logits from this dir equal
those of the checkpoint's model bit for bit (same weights, same dtype).

--fp8: exactly what the trainer pushes into vLLM (fp8/export.py export_weights(fp8=True)): every
linear fp8_plan makes FP8 as float8_e4m3fn [N, K] + `weight_scale_inv` float32 [N/128, K/128],
quantized from the master weights by fp8/quant.py; every other tensor in --dtype (default
bfloat16, what vLLM computes in); config.json gets `quantization_config` =
vllm_quantization_config (block-128 FP8, dynamic 1x128 activations, ignored_layers = the BF16
skip-list). A checkpoint trained with fp8.kv_cache adds its calibrated q/k/v scales as
`model.layers.{i}.self_attn.attn.{q,k,v}_scale`, which vLLM loads with --kv-cache-dtype fp8
(without it vLLM ignores them). For the trainer's exact numerics serve with
VLLM_USE_DEEP_GEMM_E8M0=0 (else vLLM may re-round the block scales to powers of two, as
engines.vllm.vllm_env notes). transformers loads the dir too (it dequantizes to BF16 on CPU).

The output appears atomically: it is written to a temp sibling dir and renamed into place.
"""

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from checkpoint import fsync, is_checkpoint, latest_checkpoint, load_checkpoint, replace_dir, resume_config
from errors import UserError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def find_checkpoint(path: str | Path) -> tuple[Path, Path]:
    """(run dir, checkpoint dir) for a run dir (its latest checkpoint) or a checkpoint dir."""
    path = Path(path)
    if is_checkpoint(path):
        run_dir = path.parent.parent  # <run>/checkpoints/step_N
        if not (run_dir / "config.yaml").is_file():
            raise UserError(f"{path}: a checkpoint outside a run dir (no {run_dir / 'config.yaml'}); "
                            "export from <run_dir>/checkpoints/step_N as the trainer wrote it")
        return run_dir, path
    if (path / "config.yaml").is_file():
        ckpt = latest_checkpoint(path / "checkpoints")
        if ckpt is None:
            raise UserError(f"{path}: no complete checkpoint in {path / 'checkpoints'} (set train.ckpt_every, "
                            "or let the run finish: it saves at the end)")
        return path, ckpt
    raise UserError(f"{path}: neither a run dir (no config.yaml) nor a checkpoint dir (no meta.pt + .metadata)")


def load_trained(run_dir: Path, ckpt: Path):
    """(model, tokenizer, cfg, state): the run's architecture in its master dtype on CPU, with the
    checkpoint's weights; state is the rest of the checkpoint (kv_scales, step, ...)."""
    from fp8.plan import clean_name

    cfg = resume_config(run_dir)  # config.yaml as the run wrote it, plus its resumes' overrides
    dtype = getattr(torch, cfg.model.dtype)
    if cfg.model.name_or_path == "tiny":
        from modeling import build_char_tokenizer, build_tiny_model

        tokenizer = build_char_tokenizer(cfg.model.tiny.vocab)
        model = build_tiny_model(cfg.model.tiny, tokenizer, dtype)
    else:  # architecture and tokenizer from the hub id / dir; the weights come from the checkpoint
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(cfg.model.name_or_path)
            hf_cfg = AutoConfig.from_pretrained(cfg.model.name_or_path)
        except OSError as e:
            raise UserError(f"model.name_or_path {cfg.model.name_or_path!r} of {run_dir}: cannot load its config/"
                            f"tokenizer ({str(e).splitlines()[0]})") from None
        from accelerate import init_empty_weights

        with init_empty_weights():  # parameters on meta (no 8B random init), buffers (RoPE) real
            model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
    state = load_checkpoint(ckpt, optimizer=False)  # the weights and meta, not the Adam moments
    weights = {clean_name(k): v for k, v in state.pop("model").items()}
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    missing = [k for k in missing if not (k == "lm_head.weight" and model.config.get_text_config().tie_word_embeddings)]
    if missing or unexpected:
        raise UserError(f"{ckpt}: weights do not match {type(model).__name__} of {run_dir / 'config.yaml'} "
                        f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.tie_weights()
    model.config.architectures = [type(model).__name__]  # vLLM resolves the class from this
    return model.eval(), tokenizer, cfg, state


def _save_safetensors(tensors: dict[str, torch.Tensor], out: Path, max_shard_size: str = "5GB") -> None:
    """model.safetensors, or shards + model.safetensors.index.json (the HF layout)."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: tensors[n].contiguous() for n in names}, str(out / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_export(model, tokenizer, cfg, state, out: Path, fp8: bool, dtype: torch.dtype | None) -> None:
    """Write the model dir into `out` (which must exist and be empty)."""
    if not fp8:
        if dtype is not None:
            model.to(dtype)
        model.save_pretrained(out, safe_serialization=True)
    else:
        from fp8.calibrate import kv_scales_from_state
        from fp8.export import export_weights, vllm_quantization_config
        from fp8.quant import E4M3

        dtype = dtype or torch.bfloat16
        kv_scales = kv_scales_from_state(state)  # set only by runs with fp8.kv_cache + recalibrate
        tensors = {}
        for name, t in export_weights(model, cfg.fp8, fp8=True, kv_scales=kv_scales):
            keep = t.dtype == E4M3 or name.endswith((".weight_scale_inv", "_scale"))  # fp8 bytes, fp32 scales
            tensors[name] = t if keep else t.to(dtype)
        _save_safetensors(tensors, out)
        model.config.quantization_config = vllm_quantization_config(model, cfg.fp8)
        model.config.dtype = dtype
        model.config.save_pretrained(out)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def export(src: str | Path, out: str | Path, fp8: bool = False, dtype: str | None = None,
           force: bool = False) -> Path:
    """Export the checkpoint at `src` (run dir or checkpoint dir) to the model dir `out`."""
    run_dir, ckpt = find_checkpoint(src)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise UserError(f"{out} exists and is not empty; choose another out dir or pass --force to replace it")
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: choose one of {list(DTYPES)}")
    model, tokenizer, cfg, state = load_trained(run_dir, ckpt)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_export(model, tokenizer, cfg, state, tmp, fp8, DTYPES.get(dtype))
        (tmp / "export_info.json").write_text(json.dumps(
            {"checkpoint": str(ckpt.resolve()), "step": state.get("step"), "fp8": fp8}, indent=2))
        for f in (f for f in tmp.iterdir() if f.is_file()):
            os.chmod(f, 0o644)  # safetensors writes 0600; the dir is meant to be served/shared
            fsync(f)
        replace_dir(tmp, out)  # --force: the old dir is swapped out, then removed
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("src", help="run dir (its latest checkpoint) or a checkpoint dir <run>/checkpoints/step_N")
    p.add_argument("out", help="output model dir (created atomically)")
    p.add_argument("--fp8", action="store_true", help="block-FP8 weights + scales + quantization_config for vLLM")
    p.add_argument("--dtype", choices=list(DTYPES), help="dtype of the (non-FP8) tensors; default: the trainer's "
                   "master dtype (plain), bfloat16 (--fp8)")
    p.add_argument("--force", action="store_true", help="replace a non-empty out dir")
    args = p.parse_args(argv)
    try:
        out = export(args.src, args.out, args.fp8, args.dtype, args.force)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"exported: {out}")
    return out


if __name__ == "__main__":
    main()
