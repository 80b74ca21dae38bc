"""analysis.py (the notebooks' engine) with hand-checkable values, the trainer's
log.save_batch_every knob, and both notebooks executed top to bottom on CPU, as docs/notebooks.md says."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch

import analysis as A
import observe
from losses.grpo import IS_CORRECTIONS, IS_REGISTRY, LossConfig, grpo_loss
from losses.mismatch import mismatch_metrics

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = {
    "mismatch_analysis": ["log_ratio_hist", "mismatch_by_position", "mismatch_by_step", "is_weights", "is_cap_sweep"],
    "fp8_sensitivity": ["fp8_sensitivity_linear", "fp8_sensitivity_layer_kind", "fp8_keep_topk", "kv_calibration"],
}


def make_batch(old, rollout, mask=None, **extra):
    """A minimal batch dict from [B, T] lists: input_ids are 3 + position, mask all ones."""
    old, rollout = torch.tensor(old, dtype=torch.float32), torch.tensor(rollout, dtype=torch.float32)
    B, T = old.shape
    mask = torch.ones(B, T) if mask is None else torch.tensor(mask, dtype=torch.float32)
    batch = {"old_logp": old, "rollout_logp": rollout, "bf16_logp": old.clone(), "mask": mask,
             "input_ids": torch.arange(T).repeat(B, 1) + 3, "attention_mask": torch.ones(B, T, dtype=torch.long),
             "rewards": torch.arange(B, dtype=torch.float32), "advantages": torch.zeros(B), "step": 0,
             "config": {}, "token_text": {i: chr(ord("a") + i) for i in range(26)}}
    return {**batch, **extra}


# ----------------------------------------------------------------------------- importance weights

def test_effective_sample_size_of_known_weights():
    assert A.effective_sample_size(torch.ones(5)) == pytest.approx(1.0)
    assert A.effective_sample_size(torch.tensor([1.0, 0, 0, 0])) == pytest.approx(0.25)
    assert A.effective_sample_size(torch.tensor([2.0, 1, 1])) == pytest.approx(16 / 6 / 3)
    assert A.effective_sample_size(torch.zeros(3)) == 0.0
    # masked-out entries do not count: only [2, 2] remain -> uniform
    assert A.effective_sample_size(torch.tensor([2.0, 9, 2]), torch.tensor([1, 0, 1])) == pytest.approx(1.0)


def test_cap_sweep_truncation_and_ess():
    w = torch.tensor([[0.5, 1.0, 2.0, 4.0]])
    batch = make_batch(w.log().tolist(), [[0.0] * 4])
    sweep = A.is_cap_sweep(batch, [1.5, 10.0], "tis")
    # cap 1.5: weights 0.5, 1, 1.5, 1.5 -> 2 of 4 truncated, ESS = 4.5^2 / 5.75 / 4
    assert sweep["truncated_frac"] == pytest.approx([0.5, 0.0])
    assert sweep["ess"][0] == pytest.approx(4.5 ** 2 / 5.75 / 4)
    assert sweep["weight_mean"][0] == pytest.approx(4.5 / 4)
    assert sweep["ess"][1] == pytest.approx(7.5 ** 2 / 21.25 / 4)  # no truncation: the raw weights
    # icepop with band [0.6, 1.5]: only w = 1 survives
    ice = A.is_cap_sweep(batch, [1.5], "icepop", is_floor=0.6)
    assert ice["truncated_frac"] == pytest.approx([0.75]) and ice["ess"] == pytest.approx([0.25])


def test_is_weights_by_variant_match_the_loss():
    torch.manual_seed(0)
    old, rollout = torch.randn(4, 6) * 0.5 - 2, torch.randn(4, 6) * 0.5 - 2
    mask = torch.ones(4, 6)
    mask[1, 4:] = 0
    batch = make_batch(old.tolist(), rollout.tolist(), mask.tolist(), config={"loss": {"is_cap": 1.2, "is_floor": 0.8}})
    variants = A.is_weights_by_variant(batch)
    assert list(variants) == list(IS_CORRECTIONS)  # every registered correction, in order
    for kind, v in variants.items():
        cfg = LossConfig(is_correction=kind, is_cap=1.2, is_floor=0.8)
        _, m = grpo_loss(old.clone().requires_grad_(), old, rollout, torch.ones(4), mask, cfg)
        assert v["truncated_frac"] == pytest.approx(m["is/truncated_frac"], abs=1e-6), kind
        assert v["weight_mean"] == pytest.approx(m["is/weight_mean"], abs=1e-6), kind
        assert v["weights"].shape == (int(mask.sum()),)
    assert variants["none"]["ess"] == 1.0 and variants["tis"]["zeroed_frac"] == 0.0
    assert variants["icepop"]["zeroed_frac"] == pytest.approx(variants["icepop"]["truncated_frac"])


# ----------------------------------------------------------------------------- mismatch views

def test_bypass_clip_counts_the_side_the_advantage_pushes():
    """Ratios exp(old - rollout) 1.5, 1.5, 0.5, 1.0 with advantages +, -, -, + (clip 0.2): the clip removes
    the first (above 1.2, pushed up) and the third (below 0.8, pushed down); three lie outside the window."""
    r = torch.tensor([[1.5, 1.5, 0.5, 1.0]])
    batch = make_batch(r.log().T.tolist(), [[0.0]] * 4, advantages=torch.tensor([1.0, -1.0, -1.0, 1.0]),
                       config={"loss": {"clip_low": 0.2, "clip_high": 0.2, "kl_coef": 0.1}})
    assert A.bypass_clip(batch) == pytest.approx({"clip_frac": 0.5, "outside_frac": 0.75})
    assert A.bypass_clip(batch, clip_high=0.6)["clip_frac"] == pytest.approx(0.25)  # 1.5 is inside [0.8, 1.6]


def test_worst_tokens_order_and_context():
    d = [[0.1, -0.5, 0.2, 0.0], [float("inf"), 0.3, -0.3, 0.05]]
    batch = make_batch(d, [[0.0] * 4] * 2, [[0, 1, 1, 1], [1, 1, 1, 1]])
    worst = A.worst_tokens(batch, k=4, context=2, unique=False)  # (both rows hold the same ids)
    # non-finite first, then |d| descending; the masked 0.1 never appears; ties in row-major order
    assert [(w["row"], w["position"]) for w in worst] == [(1, 0), (0, 0), (1, 1), (1, 2)]
    assert [w["log_ratio"] for w in worst[1:]] == pytest.approx([-0.5, 0.3, -0.3])
    assert worst[1]["token"] == "e" and worst[1]["context"] == "d"  # ids 3 + position -> 'd', 'e', ...
    assert worst[3]["context"] == "de" and worst[2]["reward"] == 1.0
    # identical prefixes (two samples of one prompt) are reported once with unique=True
    twin = make_batch([[0.0, 0.4], [0.0, 0.4]], [[0.0, 0.0]] * 2)
    assert len(A.worst_tokens(twin, k=5)) == 2 and len(A.worst_tokens(twin, k=5, unique=False)) == 4


def test_per_position_mismatch_aligns_responses():
    # row 0: response at positions 1-2; row 1: response at position 0 only
    d = [[9.0, 0.1, -0.2], [0.1, 9.0, 9.0]]
    batch = make_batch(d, [[0.0] * 3] * 2, [[0, 1, 1], [1, 0, 0]])
    out = A.per_position_mismatch(batch)
    assert out["position"] == [0, 1] and out["n_tokens"] == [2, 1]
    assert out["token_mult_prob_error"] == pytest.approx([math.exp(0.1), math.exp(0.2)], rel=1e-6)
    assert out["kl"] == pytest.approx([-0.1, 0.2], rel=1e-5)
    binned = A.per_position_mismatch(batch, bin_size=2)
    assert binned["n_tokens"] == [3]
    aligned, m = A.response_aligned(torch.tensor(d), batch["mask"])
    assert torch.equal(aligned, torch.tensor([[0.1, -0.2], [0.1, 0.0]])) and m.tolist() == [[1, 1], [1, 0]]


def test_log_ratio_hist_counts_finite_masked_tokens():
    batch = make_batch([[0.1, -0.2, float("nan"), 0.3]], [[0.0] * 4], [[1, 1, 1, 0]])
    h = A.log_ratio_hist(batch, bins=4, lim=0.4)
    assert int(h["counts"].sum()) == 2 and h["values"].tolist() == pytest.approx([0.1, -0.2])
    assert h["edges"].tolist() == pytest.approx([-0.4, -0.2, 0.0, 0.2, 0.4])


def test_mismatch_table_and_run_curves(tmp_path):
    batch = make_batch([[0.1, 0.2]], [[0.0, 0.0]])
    table = A.mismatch_table(batch)
    assert table["trainer vs engine"] == mismatch_metrics(batch["old_logp"], batch["rollout_logp"], batch["mask"])
    assert table["trainer FP8 vs trainer BF16"]["token_mult_prob_error"] == 1.0
    rows = [{"step": 0, "mismatch/kl": 0.5, "reward/mean": 1}, {"step": 1, "val/accuracy": 0.2},
            {"step": 1, "mismatch/kl": 0.25}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert A.run_metric_curves(tmp_path) == {"step": [0, 1], "kl": [0.5, 0.25]}
    assert A.run_metric_curves(tmp_path / "missing") == {"step": []}


# ----------------------------------------------------------------------------- batches on disk

def test_save_load_round_trip_is_bit_exact(tmp_path):
    from modeling import build_char_tokenizer

    torch.manual_seed(0)
    tok = build_char_tokenizer("0123456789+=")
    B, L = 3, 6
    ids = torch.randint(3, len(tok), (B, L))
    am = torch.ones(B, L, dtype=torch.long)
    am[2, 4:] = 0
    mask = torch.zeros(B, L)
    mask[:, 3:] = 1
    mask[2, 4:] = 0
    logps = [torch.randn(B, L) for _ in range(3)]
    logps[0][0, 3] = -math.inf
    rewards, adv = torch.tensor([1.0, 0.0, 0.5]), torch.randn(B)
    path = tmp_path / "run" / "batches" / "step_000007.pt"
    observe.save_rollout_batch(path, 7, ids, am, mask, *logps, rewards, adv, {"loss": {"is_cap": 3.0}}, tok, "tok/dir")
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # the temp file was renamed away
    batch = observe.load_rollout_batch(path)
    for name, t in zip(observe.TENSOR_FIELDS, (ids, am, mask, *logps, rewards, adv)):
        assert batch[name].dtype == t.dtype and torch.equal(batch[name], t), name
    assert batch["step"] == 7 and batch["config"] == {"loss": {"is_cap": 3.0}} and batch["tokenizer_dir"] == "tok/dir"
    assert batch["run_dir"] == str(tmp_path / "run")
    assert batch["prompt_ids"] == ids[:, :3].tolist()
    assert batch["response_ids"] == [ids[0, 3:].tolist(), ids[1, 3:].tolist(), ids[2, 3:4].tolist()]
    assert A.decode(batch, ids[0].tolist()) == tok.decode(ids[0].tolist())
    assert A.find_batches(tmp_path / "run") == [path]


def test_load_rejects_what_is_not_a_batch(tmp_path):
    torch.save({"model": {"w": torch.zeros(1)}, "step": 3}, tmp_path / "state.pt")
    with pytest.raises(ValueError, match="is not a rollout batch"):
        observe.load_rollout_batch(tmp_path / "state.pt")
    (tmp_path / "notes.pt").write_text("hello")
    with pytest.raises(ValueError, match="is not a rollout batch"):
        observe.load_rollout_batch(tmp_path / "notes.pt")
    with pytest.raises(FileNotFoundError):
        observe.load_rollout_batch(tmp_path / "nothing.pt")


def test_scratch_run_is_made_once_and_reused(tmp_path):
    """The notebooks' tiny run: made once per setting, reused by later calls, and a run of other settings
    (or one cut short) under the same dir replaced, so executions do not pile runs up; other dirs stay."""
    (tmp_path / "scratch-0123456789ab" / "batches").mkdir(parents=True)  # cut short: no scratch.json
    (tmp_path / "batch-1a2b3c4d").mkdir()  # not a scratch run
    path = A.scratch_rollout_batch(tmp_path, steps=3, overrides=["rollout.prompts_per_step=2"])
    run_dir = path.parent.parent
    assert path.is_file() and (run_dir / A.SCRATCH).is_file() and run_dir.name.startswith("scratch-")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["batch-1a2b3c4d", run_dir.name]
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_000002"]  # the batch's weights only
    made = path.stat().st_mtime_ns
    assert A.scratch_rollout_batch(tmp_path, steps=3, overrides=["rollout.prompts_per_step=2"]) == path
    assert path.stat().st_mtime_ns == made  # reused, not trained again


def test_figures_are_laid_out_before_saving(tmp_path):
    """analysis.save_figure (the notebooks' show): side-by-side panels leave room for each other's labels.
    mismatch_by_step's right panel (kl, tick labels like -0.00075) put its y label over the left panel."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig, axes = plt.subplots(1, 2, figsize=(12, 3.5))
    axes[0].plot(range(30), [1.004 + 1e-3 * (i % 7) / 7 for i in range(30)])
    axes[1].plot(range(30), [5e-4 * (i % 3) - 1.1e-3 for i in range(30)])
    axes[0].set_ylabel("token_mult_prob_error")
    axes[1].set_ylabel("kl")

    def crowded() -> list[str]:
        """Y labels and tick labels that run into another panel."""
        r = FigureCanvasAgg(fig).get_renderer()  # (save_figure closes the figure: pyplot lets go of its canvas)
        fig.draw(r)
        return [t.get_text() for a in axes for t in (a.yaxis.label, *a.get_yticklabels()) if t.get_text()
                for b in axes if b is not a and t.get_window_extent(r).overlaps(b.get_window_extent(r))]

    assert crowded() == ["kl"]  # matplotlib's default layout
    assert A.save_figure(fig, tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"
    assert crowded() == []


# ----------------------------------------------------------------------------- the trainer knob

@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """3 tiny GRPO steps (8 prompts x 8 samples) saving batches at steps 0 and 2. The training forward
    through the fused head (train.fused_head): the old_logp its one mini-batch gives the loss, the logged
    mismatch and the episode dump are then the bits of the no-grad pass the saved batch holds (through
    the unfused head they differ by float rounding)."""
    out = tmp_path_factory.mktemp("runs")
    path = A.make_rollout_batch(out, steps=3, overrides=[
        "rollout.prompts_per_step=8", "train.micro_batch_size=64", "log.dump_episodes_every=2",
        "train.fused_head=true"])
    return path, observe.load_rollout_batch(path)


def test_trainer_saves_the_batch_it_logged(tiny_run):
    path, batch = tiny_run
    run_dir = path.parent.parent
    assert path.name == "step_000002.pt" and [p.name for p in A.find_batches(run_dir)] == ["step_000000.pt", path.name]
    logged = {m["step"]: m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    recomputed = mismatch_metrics(batch["old_logp"], batch["rollout_logp"], batch["mask"])
    for k, v in recomputed.items():
        assert logged[2][f"mismatch/{k}"] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    # the episode dump of the same step holds the same trainer logprobs, token for token
    from modeling import build_char_tokenizer

    tok = build_char_tokenizer(batch["config"]["model"]["tiny"]["vocab"])
    episodes = [json.loads(line) for line in (run_dir / "episodes" / "step_000002.jsonl").read_text().splitlines()]
    for i, ep in enumerate(episodes):
        m = batch["mask"][i] != 0
        assert batch["old_logp"][i, m].tolist() == ep["trainer_logp"]
        assert batch["rollout_logp"][i, m].tolist() == pytest.approx(ep["rollout_logp"], abs=1e-7)
        assert tok.decode(batch["response_ids"][i], skip_special_tokens=True) == ep["completion"]
        assert A.decode(batch, batch["input_ids"][i]) == tok.decode(batch["input_ids"][i])
    B = batch["input_ids"].shape[0]
    assert B == 64 and batch["rewards"].shape == (B,) and batch["config"]["fp8"]["train"] is True
    # FP8 trainer vs the same weights in BF16: small, nonzero
    assert 0 < A.mismatch_table(batch)["trainer FP8 vs trainer BF16"]["max_abs_diff"] < 0.1


def test_batch_model_reproduces_saved_logprobs_and_fp8_ranking(tiny_run):
    _, batch = tiny_run
    model, _, cfg = A.load_batch_model(batch)
    assert model.batch_weights["exact"] and model.batch_weights["checkpoint"].endswith("step_000002")
    m = batch["mask"] != 0
    assert torch.equal(A.batch_logprobs(model, batch)[m], batch["bf16_logp"][m])
    names = A.convert_fp8(model, cfg)
    assert len(names) == 14  # 2 layers x 7 linears; lm_head stays BF16
    assert torch.equal(A.batch_logprobs(model, batch)[m], batch["old_logp"][m])

    rows = list(range(16))
    ranking = A.fp8_sensitivity(model, batch, "linear", rows=rows)
    assert [r["unit"] for r in ranking[:-1]] != [] and ranking[-1]["unit"] == "all" and ranking[-1]["n_linears"] == 14
    drift = [r["mean_abs_diff"] for r in ranking[:-1]]
    assert drift == sorted(drift, reverse=True) and all(v > 0 for v in drift)
    # a unit holding every FP8 linear is the whole FP8 model
    whole = A.fp8_sensitivity(model, batch, {"everything": "*"}, rows=rows)
    assert whole[0]["mean_abs_diff"] == pytest.approx(whole[-1]["mean_abs_diff"])
    assert {r["unit"] for r in A.fp8_sensitivity(model, batch, "layer", rows=rows)} == {"layers.0", "layers.1", "all"}
    assert len(A.fp8_units(model, "kind")) == 7


def test_bypass_run_saves_the_trainers_logprobs(tmp_path):
    """Under train.old_logp=rollout the loss's old_logp is the engine's; the saved batch's old_logp is still the
    trainer's (a pass for the save), so the notebooks compare trainer with engine: on the IS ablation config,
    whose engine clips q/k/v, they differ, the batch's model reproduces them, and the step's logged mismatch
    (the first mini-batch's training forward) is theirs. The episode dump has no trainer logprobs there."""
    path = A.make_rollout_batch(tmp_path, steps=2, config=ROOT / "configs/ablations/tiny_cpu_is.yaml",
                                overrides=["rollout.prompts_per_step=8", "train.old_logp=rollout",
                                           "log.dump_episodes_every=1"])
    batch = observe.load_rollout_batch(path)
    episode = json.loads((path.parent.parent / "episodes/step_000001.jsonl").read_text().splitlines()[0])
    assert episode["trainer_logp"] is None and episode["rollout_logp"]  # no trainer pass ran for the loss
    m = batch["mask"] != 0
    assert (batch["old_logp"] - batch["rollout_logp"])[m].abs().max() > 1e-3
    model, _, cfg = A.load_batch_model(batch)
    A.convert_fp8(model, cfg)
    assert torch.equal(A.batch_logprobs(model, batch)[m], batch["old_logp"][m])
    logged = [json.loads(line) for line in (path.parent.parent / "metrics.jsonl").read_text().splitlines()]
    logged = next(r for r in logged if r.get("step") == 1 and "mismatch/kl" in r)
    for k, v in mismatch_metrics(batch["old_logp"], batch["rollout_logp"], batch["mask"]).items():
        assert logged[f"mismatch/{k}"] == pytest.approx(v, rel=1e-3, abs=1e-6), k


def test_kv_quant_error_saturation_and_error(tiny_run):
    _, batch = tiny_run
    model, _, _ = A.load_batch_model(batch)
    rows = list(range(32))
    kv = A.kv_quant_error(model, batch, percentiles=(100.0,), margins=(1.0, 0.5), micro_batch=8,
                          calib_rows=rows, eval_rows=rows)
    assert len(kv["summary"]) == 2 and len(kv["per_layer"]) == 2 * 2 * 3  # settings x layers x q/k/v
    full = [r for r in kv["per_layer"] if r["margin"] == 1.0]
    half = [r for r in kv["per_layer"] if r["margin"] == 0.5]
    # calibrated on the same rows at the 100th percentile: nothing saturates, e4m3 rounding only
    assert all(r["saturated_frac"] == 0 for r in full) and all(0 < r["rel_rmse"] < 0.06 for r in full)
    assert all(r["saturated_frac"] > 0 for r in half)
    assert kv["summary"][1]["mean_abs_diff"] > kv["summary"][0]["mean_abs_diff"] > 0


# ----------------------------------------------------------------------------- notebooks

def test_committed_notebooks_have_no_outputs():
    for name in NOTEBOOKS:
        nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, (name, cell.source[:60])


def execute(name, env, out_dir):
    """The notebook run as docs/notebooks.md runs it (`jupyter execute ... --output=`); its executed copy."""
    out = out_dir / name
    p = subprocess.run([str(Path(sys.executable).parent / "jupyter"), "execute", f"notebooks/{name}.ipynb",
                        "--timeout=300", f"--output={out}"], cwd=ROOT, env={**os.environ, **env},
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return nbformat.read(out.with_suffix(".ipynb"), as_version=4)


def printed(nb) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def test_notebooks_run_top_to_bottom(tmp_path):
    """Both notebooks without BATCH_PATH: mismatch_analysis trains the tiny run, fp8_sensitivity reuses
    it; each executed copy holds the tables it printed."""
    fig_dir, run_dir = tmp_path / "figs", tmp_path / "runs"
    env = {"FIG_DIR": str(fig_dir), "RUN_DIR": str(run_dir), "BATCH_PATH": ""}
    mismatch = printed(execute("mismatch_analysis", env, tmp_path))
    for kind, correction in IS_REGISTRY.items():  # the registry's formulas, one line per correction
        assert f"{kind:14s}{correction.__doc__.splitlines()[0]}" in mismatch, kind
    (batch_path,) = run_dir.glob("scratch-*/batches/step_000029.pt")
    assert f"{batch_path}\nstep 29:" in mismatch and "trainer vs engine" in mismatch and "truncated" in mismatch
    text = printed(execute("fp8_sensitivity", env, tmp_path))
    assert f"{batch_path}\nstep 29:" in text and len(list(run_dir.iterdir())) == 1  # the same run, reused
    assert "'exact': True" in text and "max |logp - bf16_logp| on response tokens: 0.0" in text
    for names in NOTEBOOKS.values():
        for fig in names:
            png = fig_dir / f"{fig}.png"
            assert png.is_file() and png.stat().st_size > 1000, fig
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
