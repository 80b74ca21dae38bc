"""export_hf.py on CPU: a trained checkpoint -> HF model dir (plain and block-FP8 for vLLM).

Plain: transformers loads it and its logits equal the checkpoint's model's bit for bit.
FP8: names, dtypes and bytes equal the trainer's export stream (fp8/export.py), config.json
carries vllm_quantization_config, and load_exported_into_hf rebuilds the engine-side model
(W8A8 emulation + kv scales) exactly. tests/gpu/test_export_gpu.py serves it with vLLM.
"""

import json
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import export_hf
from checkpoint import latest_checkpoint, load_checkpoint
from config import load_config
from engines.hf import load_exported_into_hf
from errors import UserError
from fp8.export import export_weights, vllm_quantization_config
from fp8.quant import E4M3
from modeling import load_model_and_tokenizer

PROMPTS = ["1+2=", "4+4=", "3+0="]


def trained(run_dir, step=None):
    """(model, tokenizer, cfg, state): the run's model with the checkpoint's weights, built the trainer's way."""
    cfg = load_config(run_dir / "config.yaml")
    model, tok = load_model_and_tokenizer(cfg.model, torch.device("cpu"))
    ckpt = latest_checkpoint(run_dir / "checkpoints") if step is None else run_dir / "checkpoints" / f"step_{step:06d}"
    state = load_checkpoint(ckpt)
    model.load_state_dict(state.pop("model"))
    return model.eval(), tok, cfg, state


def logits(model, tok):
    batch = tok(PROMPTS, return_tensors="pt")
    with torch.no_grad():
        return model(**batch).logits


def test_plain_export_logits_bitwise(tiny_run, tmp_path):
    ref, ref_tok, cfg, state = trained(tiny_run)
    assert cfg.fp8.train and state["step"] == 8  # the weights come out of FP8 (emulated) training
    out = export_hf.main([str(tiny_run), str(tmp_path / "plain")])
    hf = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert hf.dtype == torch.float32 and type(hf) is type(ref)
    assert tok(PROMPTS)["input_ids"] == ref_tok(PROMPTS)["input_ids"]
    assert torch.equal(logits(hf, tok), logits(ref, ref_tok))
    assert json.loads((out / "export_info.json").read_text())["step"] == 8
    assert not list(tmp_path.glob(".*tmp*")), "temp dir left behind"

    # a checkpoint dir picks that checkpoint; a hub-style model (config + tokenizer dir) instead of 'tiny'
    run2 = tmp_path / "run2"
    (run2 / "checkpoints").mkdir(parents=True)
    shutil.copytree(tiny_run / "checkpoints" / "step_000006", run2 / "checkpoints" / "step_000006")
    raw = yaml.safe_load((tiny_run / "config.yaml").read_text())
    raw["model"]["name_or_path"] = str(tiny_run / "engine_model")  # config.json + tokenizer, no weights
    (run2 / "config.yaml").write_text(yaml.safe_dump(raw))
    out6 = export_hf.export(run2 / "checkpoints" / "step_000006", tmp_path / "plain6")
    ref6, _, _, _ = trained(tiny_run, step=6)
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(out6), tok), logits(ref6, ref_tok))

    # an existing out dir is never half-overwritten: refused, or swapped whole with --force
    with pytest.raises(UserError, match="exists and is not empty.*--force"):
        export_hf.export(tiny_run, out6)
    export_hf.export(tiny_run, out6, force=True)
    assert json.loads((out6 / "export_info.json").read_text())["step"] == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain", "plain6", "run2"]


def test_fp8_export_round_trips_into_the_engine_model(tiny_run, tmp_path):
    from engines.hf import convert_to_fp8_rollout, get_kv_scales

    ref, tok, cfg, state = trained(tiny_run)
    assert state["kv_scales"]  # trained with fp8.kv_cache: calibrated scales in the checkpoint
    out = export_hf.export(tiny_run, tmp_path / "fp8", fp8=True)
    files = load_file(str(out / "model.safetensors"))

    # exactly the trainer's stream to vLLM, non-FP8 tensors in bfloat16
    def bf16(name, t):
        return t if t.dtype == E4M3 or name.endswith(("_scale_inv", "_scale")) else t.to(torch.bfloat16)
    want = {n: bf16(n, t) for n, t in export_weights(ref, cfg.fp8, fp8=True, kv_scales=state["kv_scales"])}
    assert files.keys() == want.keys()
    n_fp8 = 0
    for name, t in want.items():
        assert files[name].dtype == t.dtype and files[name].shape == t.shape, name
        assert torch.equal(files[name].view(torch.uint8), t.view(torch.uint8)) if t.dtype == E4M3 \
            else torch.equal(files[name], t), name
        n_fp8 += t.dtype == E4M3
    assert n_fp8 == 14 and sum(n.endswith(".self_attn.attn.k_scale") for n in files) == 2
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == vllm_quantization_config(ref, cfg.fp8)
    assert config["dtype"] == "bfloat16" and config["architectures"] == ["LlamaForCausalLM"]

    # the files rebuild the engine's model: W8A8 on the pinned FP8 bytes, FP8 attention at the scales
    def engine_model(pairs):
        m, _ = load_model_and_tokenizer(cfg.model, torch.device("cpu"))
        convert_to_fp8_rollout(m, cfg.fp8)
        load_exported_into_hf(m, pairs)
        return m.eval()
    from_files = engine_model(files.items())
    from_stream = engine_model(want.items())
    assert get_kv_scales(from_files) == {i: tuple(map(float, s)) for i, s in state["kv_scales"].items()}
    assert torch.equal(logits(from_files, tok), logits(from_stream, tok))

    # transformers loads it too (on CPU it dequantizes the FP8 blocks to bf16): the same weights
    hf = AutoModelForCausalLM.from_pretrained(out).state_dict()
    plain = load_model_and_tokenizer(cfg.model, torch.device("cpu"))[0].to(torch.bfloat16)
    load_exported_into_hf(plain, files.items())
    assert hf.keys() == plain.state_dict().keys()
    assert all(torch.equal(hf[n], t) for n, t in plain.state_dict().items())


def test_bad_sources_name_the_problem(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        export_hf.main([str(tmp_path), str(tmp_path / "out")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "neither a run dir (no config.yaml) nor a checkpoint dir" in err
    (tmp_path / "config.yaml").write_text("{}\n")
    with pytest.raises(UserError, match="no complete checkpoint in .*checkpoints"):
        export_hf.export(tmp_path, tmp_path / "out")
