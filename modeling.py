"""Model and tokenizer: a hub id or local HF dir, or a tiny model of a family in models/ built from a config.

The tiny model uses a character-level tokenizer the repo builds with `tokenizers` and saves
as a normal HF tokenizer dir, so tests and the CPU default download nothing and vLLM can
load the same directory (config.json + tokenizer, weights pushed by our refit).
"""

import importlib.util
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from config import ModelConfig, TinyModelConfig
from errors import UserError
from models import family

SPECIALS = ["<pad>", "<bos>", "<eos>"]


def build_char_tokenizer(vocab: str) -> PreTrainedTokenizerFast:
    """One token per character of `vocab` plus <pad>=0, <bos>=1, <eos>=2; BOS is prepended."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    chars = list(dict.fromkeys(vocab))  # dedupe, keep order
    ids = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(ids, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<pad>")


def check_char_vocab(vocab: str, texts: list[str]) -> None:
    """The char tokenizer reads a character outside `vocab` as <pad>, which would silently blank out
    parts of the prompts: refuse it, naming the characters."""
    missing = sorted(set("".join(texts)) - set(vocab))
    if missing:
        raise UserError(f"model.tiny.vocab lacks characters the prompts use: {''.join(missing)!r} (the tiny char "
                        "tokenizer would read them as <pad>); add them to model.tiny.vocab, or change the data/template")


def build_tiny_model(t: TinyModelConfig, tokenizer, dtype: torch.dtype):
    """A randomly initialised model of family t.arch (models/<arch>.py: its HF config and model class)
    with the tiny dims (seeded by the caller), built in `dtype` on the current default device
    (load_model_and_tokenizer builds it on the target device: an 8B-shape benchmark model
    initialises on the GPU in seconds)."""
    import transformers

    spec = family(t.arch)
    cls_cfg, cls_model = getattr(transformers, spec.config_class), getattr(transformers, spec.model_class)
    hf_cfg = cls_cfg(vocab_size=max(len(tokenizer), t.vocab_size), hidden_size=t.hidden_size,
                     intermediate_size=t.intermediate_size, num_hidden_layers=t.num_layers,
                     num_attention_heads=t.num_heads, num_key_value_heads=t.num_kv_heads, head_dim=t.head_dim,
                     max_position_embeddings=t.max_position_embeddings, tie_word_embeddings=False,
                     bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id, **(spec.tiny_config(t) if spec.tiny_config else {}))
    return cls_model._from_config(hf_cfg, dtype=dtype)


def resolve_attn_implementation(name: str) -> str:
    if name != "auto":
        return name
    has_fa = importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available()
    return "flash_attention_2" if has_fa else "sdpa"


_CACHE_KEY_TAG = torch.compiler.config.cache_key_tag  # the user's (TORCH_COMPILE_CACHE_KEY_TAG)


def pin_sdpa_backends(cudnn: bool) -> None:
    """PyTorch's attention (SDPA) with (or without) cuDNN's kernel, fixed for the whole process before the
    trainer's first forward. The first import of vLLM's CUDA platform module (vllm/platforms/cuda.py) turns
    cuDNN's SDPA off for the process, and the engine's start or an FP8 kernel's first import (DeepGEMM, through
    vLLM) does that somewhere in a run: a compiled layer keeps the kernel it was traced with, and an eager
    checkpointed layer whose recompute comes after the switch gets another kernel than its forward saved for
    (CheckpointError). So that module is imported here first, on the GPU where vLLM is installed, and then
    the switch is set. vLLM's own attention does not go through SDPA. cuDNN's kernel runs ~1.6-1.75x
    FlashAttention-2's per call once its plan for a shape is cached, but builds one for each new length: the
    shipped steps gained nothing from it (docs/results.md).
    torch.compile picks the kernel while it traces, and its caches (inductor's and AOTAutograd's, on disk
    across runs) do not key on the switch: the switch goes into their key tag, else a run would reuse
    graphs compiled with the other kernel."""
    if torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None:
        import vllm.platforms.cuda  # noqa: F401  (its one-time switch, now rather than mid-run)
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    torch.compiler.config.cache_key_tag = f"{_CACHE_KEY_TAG}cudnn_sdp={int(cudnn)}"


def load_model_and_tokenizer(cfg: ModelConfig, device: torch.device):
    dtype = getattr(torch, cfg.dtype)
    attn = resolve_attn_implementation(cfg.attn_implementation)
    if cfg.name_or_path == "tiny":
        tokenizer = build_char_tokenizer(cfg.tiny.vocab)
        with torch.device(device):
            model = build_tiny_model(cfg.tiny, tokenizer, dtype)
        model.config._attn_implementation = attn
    else:
        path = cfg.name_or_path
        looks_local = path.startswith((".", "/", "~")) or Path(path).expanduser().exists()
        if looks_local and not (Path(path).expanduser() / "config.json").is_file():
            raise UserError(f"model.name_or_path: {path!r} is not a model directory (no config.json); "
                            "give a local HF model dir, a hub id, or 'tiny'")
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
            if device.type == "meta":  # the structure only (an async vLLM engine rank): no weights read
                with torch.device("meta"):
                    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype,
                                                             attn_implementation=attn)
            else:
                model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn)
        except OSError as e:
            raise UserError(f"model.name_or_path: cannot load {path!r} ({str(e).splitlines()[0]}); "
                            "check the id/path, or pre-download it to the HF cache") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(every_n_layers=cfg.gradient_checkpointing_every)
    return model.to(device), tokenizer


def save_model_dir(model, tokenizer, path: str | Path) -> Path:
    """Write config + tokenizer (+ weights) as a HF model dir that transformers and vLLM load."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def save_config_dir(model, tokenizer, path: str | Path) -> Path:
    """config.json + tokenizer only: enough for a vLLM engine started with load_format='dummy'."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # without "architectures" vLLM resolves the headless LlamaModel instead of LlamaForCausalLM
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    gen = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path
