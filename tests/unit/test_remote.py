"""engines/remote.py's messages without processes: what trainer rank 0 sends for a version of the
weights, how an engine rank applies it (FP8 bytes included), and the prompt check on every batch.
(tests/e2e/test_async.py runs the real thing over gloo.)"""

import pickle

import pytest
import torch

import distributed
from config import load_config
from engines import remote
from errors import UserError


class Wire:
    """send/recv over a list, through pickle as over the link; the weights' broadcast over another."""

    def __init__(self, monkeypatch, replies=()):
        self.sent, self.replies, self.bytes = [], list(replies), []
        monkeypatch.setattr(remote, "send", lambda d, obj, dst: self.sent.append((pickle.loads(pickle.dumps(obj)), dst)))
        monkeypatch.setattr(remote, "recv", lambda d, src: self.replies.pop(0))
        monkeypatch.setattr(remote, "broadcast", self.broadcast)

    def broadcast(self, d, t):
        assert t.dtype == torch.uint8 and t.dim() == 1  # bytes, whatever the tensor's dtype
        if d.engine < 0:
            self.bytes.append(t.clone())
        else:
            t.copy_(self.bytes.pop(0))


class Recorder:
    def __init__(self):
        self.weights, self.scales = [], []

    def update_weights(self, pairs):
        self.weights.append(list(pairs))

    def set_kv_scales(self, scales):
        self.scales.append(scales)


def trainer(rank=0):
    return remote.RemoteEngine(load_config(None, ["rollout.mode=async"]),
                               distributed.Dist(rank=rank, world=2, engines=1))


def test_a_version_reaches_the_engine_whole_fp8_bytes_included(monkeypatch):
    wire = Wire(monkeypatch)
    w8 = torch.tensor([1.5, -448.0, 0.015625]).to(torch.float8_e4m3fn)  # exactly representable
    eng = trainer()
    eng.start(3, {"epoch": 0, "position": 8})
    scale = torch.tensor([[0.5, 0.25]])
    eng.update_weights(iter([("a.weight", w8), ("a.weight_scale_inv", scale), ("norm.weight", torch.ones(()))]))
    eng.set_kv_scales({0: (1.0, 2.0, 3.0)})
    eng.close()
    assert [dst for _, dst in wire.sent] == [2] * 7  # every message to the one engine, global rank 2
    assert [m[0] for m, _ in wire.sent] == ["start", "tensor", "tensor", "tensor", "scales", "version", "stop"]
    assert wire.sent[1][0] == ("tensor", "a.weight", (3,), "float8_e4m3fn")  # the header; the bytes by broadcast
    assert [t.numel() for t in wire.bytes] == [3, 8, 4]
    assert wire.sent[5][0] == ("version", 3)  # the first version is the start step's

    # the engine rank: the tensors streamed into the engine, the scales and the version after them
    wire.replies = [m for m, _ in wire.sent[1:]]
    engine = Recorder()
    pulled = remote._Weights(distributed.Dist(rank=2, world=2, engine=0, engines=1), engine)
    pulled.pull(3)
    (pairs,) = engine.weights
    assert [n for n, _ in pairs] == ["a.weight", "a.weight_scale_inv", "norm.weight"]
    assert pairs[0][1].dtype == torch.float8_e4m3fn and torch.equal(pairs[0][1].view(torch.uint8), w8.view(torch.uint8))
    assert torch.equal(pairs[1][1], scale) and pairs[2][1].shape == () and float(pairs[2][1]) == 1.0
    assert engine.scales == [{0: (1.0, 2.0, 3.0)}] and pulled.version == 3 and wire.bytes == []
    pulled.pull(4)  # the stop ends the wait for a version that never comes
    assert pulled.stopped and pulled.version == 3


def test_an_engine_that_leaves_tensors_unread_is_an_error(monkeypatch):
    wire = Wire(monkeypatch)
    eng = trainer()
    eng.start(0, {})
    eng.update_weights(iter([("a.weight", torch.ones(2)), ("b.weight", torch.ones(2))]))
    eng.close()
    wire.replies = [m for m, _ in wire.sent[1:]]

    class TakesOne(Recorder):
        def update_weights(self, pairs):
            next(pairs)

    with pytest.raises(RuntimeError, match="left tensors of the stream unread"):
        remote._Weights(distributed.Dist(rank=1, world=1, engine=0, engines=1), TakesOne()).pull(0)


def test_a_vllm_engine_rank_needs_a_gpu():
    cfg = load_config(None, ["rollout.mode=async", "rollout.engine=vllm"])
    with pytest.raises(UserError, match="rollout.engine=vllm needs a CUDA GPU on each engine rank"):
        remote.serve(cfg, distributed.Dist(rank=1, world=1, engine=0, engines=1))


def test_only_trainer_rank_0_sends(monkeypatch):
    wire = Wire(monkeypatch)
    eng = trainer(rank=1)
    eng.start(0, {})
    eng.update_weights(iter([("a.weight", torch.ones(2))]))
    eng.close()
    assert wire.sent == [] and wire.bytes == []


def test_a_batch_for_other_prompts_is_refused(monkeypatch):
    Wire(monkeypatch, replies=[("rollout", [[5, 6]], [], 0.1), ("rollout", [[1, 2]], ["sample"], 0.2)])
    eng = trainer()
    with pytest.raises(RuntimeError, match="other prompts than this trainer rank asked for"):
        eng.generate([[1, 2]], n=2, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=0)
    assert eng.generate([[1, 2]], n=2, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=0) == ["sample"]
    assert eng.generate_s == 0.2  # the engine's time on that batch, for rollout/engine_s
