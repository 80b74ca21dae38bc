"""engines/vllm_internals.py (every vLLM internal the recipe touches) and scripts/vllm_upgrade_check.py, on CPU.

The source checks read vLLM's files with ast, so they run against the installed 0.26 here and against a copy
of it with internals taken out, which must be named. VLLM_UPGRADE_SOURCE=<dir holding vllm/> also checks a
newer release's unpacked wheel (docs/vllm_upgrade.md).
"""

import logging
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from config import load_config
from engines import vllm_internals as vi
from errors import UserError
from scripts import vllm_upgrade_check as upgrade


@pytest.fixture(scope="module")
def installed():
    try:
        return vi.installed_source()
    except UserError as e:
        pytest.skip(str(e))


def test_every_internal_is_in_the_pinned_vllm(installed):
    assert vi.missing(installed) == []
    assert {i.when for i in vi.needed(load_config(None, ["fp8.kv_cache=true", "fp8.kv_attention=xqa"]))} == {
        "engine", "kv_cache", "xqa"}
    assert {i.when for i in vi.needed(load_config(None, []))} == {"engine"}


@pytest.fixture
def cut_vllm(installed, tmp_path):
    """A copy of the installed vLLM's files that the checks read, with three things taken out: the scheduler's
    preemption hook, the worker's reload_weights, and EngineArgs.linear_backend."""
    files = {"engine/arg_utils.py", "sampling_params.py", "config/attention.py", "config/compilation.py"}
    for i in vi.INTERNALS:
        path = vi._module_file(installed, i.module)
        files.add(str(path.relative_to(installed / "vllm")))
    for rel in files:
        (tmp_path / "vllm" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(installed / "vllm" / rel, tmp_path / "vllm" / rel)
    for rel, old, new in [("v1/core/sched/scheduler.py", "def _preempt_request(", "def _gone("),
                          ("v1/worker/gpu_worker.py", "def reload_weights(", "def _gone("),
                          ("engine/arg_utils.py", "    linear_backend:", "    _gone:")]:
        p = tmp_path / "vllm" / rel
        assert old in p.read_text(), (rel, old)
        p.write_text(p.read_text().replace(old, new))
    vi._names.cache_clear()
    yield tmp_path
    vi._names.cache_clear()


def test_missing_internals_are_named(cut_vllm, monkeypatch):
    gone = {(str(i), why) for i, why in vi.missing(cut_vllm)}
    assert gone == {
        ("vllm.v1.core.sched.scheduler:Scheduler._preempt_request",
         "vllm.v1.core.sched.scheduler.Scheduler has no _preempt_request"),
        ("vllm.v1.worker.gpu_worker:Worker.reload_weights", "vllm.v1.worker.gpu_worker.Worker has no reload_weights")}
    monkeypatch.setattr(vi, "installed_source", lambda: cut_vllm)
    monkeypatch.setattr(vi, "vllm_version", lambda: "9.9.9")
    with pytest.raises(UserError, match=r"^vLLM 9\.9\.9: vllm\.v1\.worker\.gpu_worker\.Worker has no reload_weights, "
                                        r"which the recipe uses for weight refit .* verified with vLLM 0\.26\.0"):
        vi.check_installed(load_config(None, []))


def test_upgrade_check_reports_what_would_not_start(cut_vllm, installed, capsys):
    report, ok = upgrade.check(cut_vllm)
    assert not ok and "verdict: a shipped config would NOT start" in report
    assert "- llama31_8b_fp8.yaml: NOT ACCEPTED: linear_backend" in report  # FP8 rollouts pick CUTLASS by name
    assert "- llama31_8b_bf16.yaml: accepted" in report
    assert "MISSING [metric] preemption count" in report
    assert "MISSING [engine, engine refuses to start] weight refit (layerwise reload)" in report
    assert upgrade.main(["--source", str(installed)]) == 0
    assert "every shipped config would start" in capsys.readouterr().out
    assert upgrade.main(["--source", str(cut_vllm / "vllm")]) == 2  # the dir above vllm/ is meant


def test_the_removed_calculate_kv_scales_would_be_caught(cut_vllm):
    fields = upgrade.class_fields(cut_vllm / "vllm" / "engine" / "arg_utils.py", "EngineArgs")
    assert upgrade.unknown_args(cut_vllm / "vllm", {"calculate_kv_scales": False, "dtype": "bfloat16"},
                                fields - {"calculate_kv_scales"}) == ["calculate_kv_scales"]
    nested = {"compilation_config": {"pass_config": {"fuse_allreduce_rms": False, "no_such_pass": True}}}
    assert upgrade.unknown_args(cut_vllm / "vllm", nested, fields) == ["compilation_config.pass_config.no_such_pass"]


@pytest.mark.skipif(not os.environ.get("VLLM_UPGRADE_SOURCE"), reason="set VLLM_UPGRADE_SOURCE=<dir holding vllm/>")
def test_a_newer_vllm_would_start():
    report, ok = upgrade.check(Path(os.environ["VLLM_UPGRADE_SOURCE"]))
    print(report)
    assert ok, report


def test_reload_filter_drops_only_known_noise():
    """The filter sits on the logger vLLM's layerwise reload logs to; it drops the per-refit RotaryEmbedding
    line always and ParallelLMHead's only for a head seen to share the embedding's storage."""
    seen = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    log = logging.getLogger(vi.RELOAD_LOGGER)
    log.addHandler(handler)
    try:
        for tied in (False, True):
            vi.install_reload_filter(tied)
            for layer in ("RotaryEmbedding", "ParallelLMHead", "QKVParallelLinear"):
                log.warning("%s: Failed to load weights", layer)
        assert sum(isinstance(f, vi.quiet_reload) for f in log.filters) == 1  # replaced, not stacked
    finally:
        log.removeHandler(handler)
        for f in list(log.filters):
            log.removeFilter(f)
    assert seen == ["ParallelLMHead: Failed to load weights", "QKVParallelLinear: Failed to load weights",
                    "QKVParallelLinear: Failed to load weights"]


def test_reload_logger_is_the_layerwise_modules(installed):
    pytest.importorskip("vllm")
    import importlib

    assert importlib.import_module(vi.RELOAD).logger.name == vi.RELOAD_LOGGER


def test_head_is_embedding_only_when_it_shares_the_storage():
    embed = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    m = nn.Module()
    m.model, m.lm_head = nn.Module(), head
    m.model.embed_tokens = embed
    assert not vi.head_is_embedding(m)
    head.weight = embed.weight  # what vLLM's ParallelLMHead.tie_weights does
    assert vi.head_is_embedding(m)


def test_preemptions_are_counted_through_the_scheduler():
    """count_preemptions wraps the in-process scheduler's _preempt_request: each preemption is counted and
    still happens; an engine without that path is left alone (False)."""
    done = []
    scheduler = SimpleNamespace(_preempt_request=lambda request, timestamp: done.append((request, timestamp)))
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(engine_core=SimpleNamespace(
        scheduler=scheduler))))
    count = []
    assert vi.count_preemptions(llm, lambda: count.append(1))
    scheduler._preempt_request("r1", 1.0)
    scheduler._preempt_request("r2", timestamp=2.0)
    assert len(count) == 2 and done == [("r1", 1.0), ("r2", 2.0)]
    assert not vi.count_preemptions(SimpleNamespace(llm_engine=SimpleNamespace()), lambda: None)


def test_v2_runner_when_the_release_has_no_v1():
    llm = lambda **c: SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(**c)))  # noqa: E731
    assert vi.uses_v2_runner(llm(use_v2_model_runner=False)) is False
    assert vi.uses_v2_runner(llm(use_v2_model_runner=True)) is True
    assert vi.uses_v2_runner(llm()) is True  # vLLM 0.34 removed V1 and the property with it


def test_kv_scales_written_in_place_with_their_mirrors():
    attn = SimpleNamespace(**{f"_{x}_scale": torch.tensor(1.0) for x in "qkv"},
                           **{f"_{x}_scale_cpu": torch.tensor(1.0) for x in "kv"})
    ids = [id(getattr(attn, f"_{x}_scale")) for x in "qkv"]
    vi.write_kv_scales(attn, 0.5, 2.0, 3.0)
    assert vi.read_kv_scales(attn) == (0.5, 2.0, 3.0) and ids == [id(getattr(attn, f"_{x}_scale")) for x in "qkv"]
    assert (attn._q_scale_float, attn._k_scale_float, attn._v_scale_float) == (0.5, 2.0, 3.0)
    assert (attn._k_scale_cpu.item(), attn._v_scale_cpu.item()) == (2.0, 3.0)


def test_an_engine_stops_before_starting_when_an_internal_is_missing(cut_vllm, monkeypatch, tmp_path):
    """VLLMEngine checks the installed vLLM before building vllm.LLM: a missing internal is one UserError
    (train_grpo.py prints it as `error: ...`, exit 2), not an AttributeError minutes into the start."""
    pytest.importorskip("vllm")
    from engines.vllm import VLLMEngine, vllm_env
    from modeling import build_char_tokenizer, build_tiny_model

    cfg = load_config(None, ["rollout.engine=vllm"])
    for k, v in vllm_env(cfg).items():  # the engine sets them; restored after the test
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(vi, "installed_source", lambda: cut_vllm)
    monkeypatch.setattr("vllm.LLM", lambda **kw: pytest.fail("vllm.LLM built despite a missing internal"))
    tok = build_char_tokenizer(cfg.model.tiny.vocab)
    model = build_tiny_model(cfg.model.tiny, tok, torch.float32)
    with pytest.raises(UserError, match=r"^vLLM .*: vllm\.v1\.worker\.gpu_worker\.Worker has no reload_weights"):
        VLLMEngine(cfg, model, tok, torch.device("cpu"), model_dir=str(tmp_path))
