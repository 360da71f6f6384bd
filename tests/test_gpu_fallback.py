"""GPUs that are not sm_90 take the dense path (kernels/device.py), tested on the CPU by faking the device: the
decision per capability, one warning per GPU, no build attempted, and the op, the model and the training entry
points computing dense results there."""
from __future__ import annotations

import warnings

import pytest
import torch

import sfl.kernels.device as device
import sfl.kernels.loader as loader
import sfl.kernels.train_ffn as train_ffn
from sfl.kernels import reference as ref
from sfl.kernels.config import KernelConfig
from sfl.kernels.twell import ops

CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend CUDA device 0 is the GPU set by the returned function (name, capability); counts capability queries."""
    monkeypatch.setattr(device, "_SUPPORT", {})
    monkeypatch.setattr(device, "_WARNED", set())
    monkeypatch.setattr(device, "_FALLBACK", {})
    state = {"name": "NVIDIA A100-SXM4-80GB", "cap": (8, 0), "queries": 0}

    def capability(i=None):
        state["queries"] += 1
        return state["cap"]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: state["name"])
    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)

    def set_gpu(name: str, cap: tuple[int, int]) -> dict:
        state.update(name=name, cap=cap)
        return state

    return set_gpu


@pytest.fixture
def no_build(monkeypatch):
    """Fail the test if anything tries to build or load the extension."""
    def refuse(*a, **k):
        raise AssertionError("a build of the extension was attempted")

    monkeypatch.setattr(loader, "build_extension", refuse)
    monkeypatch.setattr(ops, "load", refuse)


@pytest.mark.parametrize("name,cap,ok", [
    ("NVIDIA H100 80GB HBM3", (9, 0), True), ("NVIDIA H200", (9, 0), True),
    ("NVIDIA A100-SXM4-80GB", (8, 0), False), ("NVIDIA L40S", (8, 9), False),
    ("NVIDIA GeForce RTX 4090", (8, 9), False), ("NVIDIA B200", (10, 0), False),
    ("NVIDIA GeForce RTX 5090", (12, 0), False)])
def test_only_sm90_runs_the_kernels(name, cap, ok):
    got, why = device.decide(name, cap)
    assert got is ok
    if not ok:
        assert name in why and f"sm_{cap[0]}{cap[1]}" in why and "sm_90" in why
    assert device.decide("AMD Instinct MI250X", (9, 0), rocm=True)[0] is False  # ROCm's gfx90a also reads (9, 0)


def test_decision_is_cached_per_device(fake_gpu):
    state = fake_gpu("NVIDIA L40S", (8, 9))
    assert device.kernels_supported(CUDA0) == device.kernels_supported(0) == device.kernels_supported()
    assert device.kernels_supported()[0] is False and state["queries"] == 1


def test_one_warning_per_gpu_and_no_build(fake_gpu, no_build):
    fake_gpu("NVIDIA B200", (10, 0))
    with pytest.warns(RuntimeWarning, match=r"sm_90 \(Hopper\).*NVIDIA B200 is sm_100: using the dense path") as rec:
        assert device.dense_fallback(CUDA0) is True
        assert device.dense_fallback(CUDA0) is True
    assert len([w for w in rec if "sfl:" in str(w.message)]) == 1
    with pytest.raises(loader.KernelUnavailableError, match="NVIDIA B200 is sm_100"):
        loader.load_twell()
    from sfl.kernels.train import ops as train_ops

    with pytest.raises(loader.KernelUnavailableError, match="NVIDIA B200 is sm_100"):
        train_ops.load_ext()


def test_hopper_and_cpu_keep_the_kernel_path(fake_gpu):
    fake_gpu("NVIDIA H200", (9, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert device.dense_fallback(CUDA0) is False
        assert device.dense_fallback(torch.device("cpu")) is False


def _as_if_on_gpu(monkeypatch, module):
    """Route `module`'s dispatch for these CPU tensors through the faked CUDA device 0."""
    monkeypatch.setattr(module, "dense_fallback", lambda dev: device.dense_fallback(CUDA0))


@pytest.mark.parametrize("gated", [True, False])
def test_the_op_takes_the_dense_path(fake_gpu, no_build, monkeypatch, gated):
    fake_gpu("NVIDIA A100-SXM4-80GB", (8, 0))
    _as_if_on_gpu(monkeypatch, ops)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 64, generator=g)
    wg, wu = torch.randn(512, 64, generator=g), torch.randn(512, 64, generator=g)
    wd = torch.randn(512, 64, generator=g).t()  # neuron-major, as the model stores W_d for the kernels
    stats = torch.zeros(3, dtype=torch.int64)
    with pytest.warns(RuntimeWarning, match="A100.*sm_80: using the dense path"):
        y = ops.ffn(x, wg if gated else None, wu, wd, ops.Plan(KernelConfig(mode="sparse")), stats)
    want = ref.gated_ffn_dense(x, wg, wu, wd) if gated else ref.nongated_ffn_dense(x, wu, wd)
    torch.testing.assert_close(y, want)
    nnz = (torch.relu(x @ (wg if gated else wu).t()) != 0).sum(-1).flatten()
    assert stats.tolist() == [int(nnz.sum()), int(nnz.max()), 10]


def test_the_model_takes_the_dense_path(fake_gpu, no_build, monkeypatch):
    from sfl.models.configuration_sparse_llama import SparseLlamaConfig
    from sfl.models.modeling_sparse_llama import SparseLlamaForCausalLM

    fake_gpu("NVIDIA GeForce RTX 4090", (8, 9))
    _as_if_on_gpu(monkeypatch, ops)
    cfg = SparseLlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=4, mlp_impl="dense")
    torch.manual_seed(0)
    model = SparseLlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        want = model(ids).logits
        model.set_mlp_impl("cuda")
        with pytest.warns(RuntimeWarning, match="RTX 4090 is sm_89") as rec:
            got = model(ids).logits
    assert len([w for w in rec if "sfl:" in str(w.message)]) == 1  # one warning for all layers
    torch.testing.assert_close(got, want)


def test_training_entry_points_take_the_dense_path(fake_gpu, no_build, monkeypatch):
    fake_gpu("NVIDIA A100-SXM4-80GB", (8, 0))
    _as_if_on_gpu(monkeypatch, train_ffn)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 64, generator=g, requires_grad=True)
    wg, wu = torch.randn(256, 64, generator=g), torch.randn(256, 64, generator=g)
    wd = torch.randn(64, 256, generator=g)
    with pytest.warns(RuntimeWarning, match="sm_80: using the dense path"):
        y, l1, st = train_ffn.sparse_gated_ffn_train(x, wg, wu, wd, mode="sparse")  # sparse on the CPU's torch backend
    assert st["path"] == "dense"
    torch.testing.assert_close(y, ref.gated_ffn_dense(x, wg, wu, wd))
    y.sum().backward()
    assert x.grad is not None
