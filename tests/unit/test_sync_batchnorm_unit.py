"""SyncBatchNorm without a process group: conversion, BatchNorm equivalence, shapes, eval.

The multi-rank maths is tested on real Gloo ranks in tests/dist/test_sync_batchnorm.py;
here a fake all-reduce that doubles its tensor stands in for two identical ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

import scaletrain.dist.sync_batchnorm as sbn
from scaletrain.dist.sync_batchnorm import SyncBatchNorm, _takes_bias, sync_batchnorm
from scaletrain.errors import ConfigError

C = 3
# Input shape after (N, C) for each BatchNorm kind, and the class that accepts it.
SHAPES: dict[str, tuple[tuple[int, ...], type[_BatchNorm]]] = {
    "NC": ((), nn.BatchNorm1d),
    "NCL": ((5,), nn.BatchNorm1d),
    "NCHW": ((4, 3), nn.BatchNorm2d),
    "NCDHW": ((2, 3, 2), nn.BatchNorm3d),
}


def _randomise(bn: _BatchNorm, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if bn.weight is not None:
            bn.weight.copy_(torch.rand(bn.num_features, generator=g) + 0.5)
        if bn.bias is not None:
            bn.bias.copy_(torch.randn(bn.num_features, generator=g))
        if bn.running_mean is not None and bn.running_var is not None:
            bn.running_mean.copy_(torch.randn(bn.num_features, generator=g))
            bn.running_var.copy_(torch.rand(bn.num_features, generator=g) + 0.5)


def _pair(kind: str, dtype: torch.dtype = torch.float32, **kwargs: Any) -> tuple[nn.Module, ...]:
    """A BatchNorm of the right kind and a SyncBatchNorm with the same state."""
    _, cls = SHAPES[kind]
    ref = cls(C, dtype=dtype, **kwargs)
    _randomise(ref, seed=7)
    ours = SyncBatchNorm(C, dtype=dtype, **kwargs)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _input(kind: str, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # A mean of 2 and std of 3: the statistics are not trivially 0 and 1.
    return torch.randn(n, C, *SHAPES[kind][0], generator=g, dtype=dtype) * 3 + 2


def _run(bn: nn.Module, x: torch.Tensor, weights: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.clone().requires_grad_()
    y = bn(x)
    # A random weighting: with loss = y.sum() BatchNorm's input gradient is exactly zero.
    (y * weights).sum().backward()
    out = {"y": y.detach(), "grad_x": x.grad}
    for name, p in bn.named_parameters():
        out[f"grad_{name}"] = p.grad.clone()
        p.grad = None
    return out


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if tol:
            torch.testing.assert_close(a[key], b[key], **tol, msg=key)
        else:
            assert torch.equal(a[key], b[key]), key


# -- conversion ------------------------------------------------------------------------


def _zoo() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3),
        nn.BatchNorm2d(4),
        nn.Sequential(nn.Flatten(), nn.Linear(4, 6), nn.BatchNorm1d(6, momentum=None)),
    )
    model.add_module("bn3", nn.BatchNorm3d(2, eps=1e-3, affine=False))
    model.add_module("untracked", nn.BatchNorm1d(5, track_running_stats=False))
    if _takes_bias(_BatchNorm.__init__):  # torch 2.13 on; none before
        model.add_module("nobias", nn.BatchNorm1d(5, bias=False))
    for i, bn in enumerate(m for m in model.modules() if isinstance(m, _BatchNorm)):
        _randomise(bn, seed=i)
        if bn.num_batches_tracked is not None:
            bn.num_batches_tracked.fill_(i + 3)
    model[1].weight.requires_grad_(False)
    model[2][2].eval()
    return model


def test_conversion_keeps_every_tensor_setting_and_flag() -> None:
    model = _zoo()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    layers = {n: m for n, m in model.named_modules() if isinstance(m, _BatchNorm)}
    tensors = {n: (dict(m.named_parameters()), dict(m.named_buffers())) for n, m in layers.items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    out = sync_batchnorm(model)

    assert out is model
    converted = {n: m for n, m in model.named_modules() if isinstance(m, _BatchNorm)}
    assert converted.keys() == layers.keys()
    for name, new in converted.items():
        old = layers[name]
        assert type(new) is SyncBatchNorm, name
        assert new.process_group is None
        for attr in ("num_features", "eps", "momentum", "affine", "track_running_stats"):
            assert getattr(new, attr) == getattr(old, attr), (name, attr)
        assert new.training == old.training
        params, buffers = tensors[name]
        # The very same objects: an optimizer built before the conversion still works.
        for key, p in new.named_parameters():
            assert p is params[key], (name, key)
        for key, b in new.named_buffers():
            assert b is buffers[key], (name, key)
        assert (new.bias is None) == (old.bias is None)
    assert not model[1].weight.requires_grad and model[1].bias.requires_grad
    assert not model[2][2].training and model[1].training
    assert model.state_dict().keys() == before.keys()
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {
        id(p) for p in model.parameters()
    }


def test_conversion_of_a_bare_layer_returns_the_new_layer_and_keeps_dtype() -> None:
    bn = nn.BatchNorm2d(4, momentum=0.3, dtype=torch.float64).eval()
    out = sync_batchnorm(bn, process_group="group-sentinel")
    assert type(out) is SyncBatchNorm
    assert out.process_group == "group-sentinel"
    assert out.weight is bn.weight and out.weight.dtype == torch.float64
    assert out.momentum == 0.3 and not out.training


def test_implementation_choice() -> None:
    assert type(sync_batchnorm(nn.BatchNorm1d(2), implementation="torch")) is nn.SyncBatchNorm
    assert type(sync_batchnorm(nn.BatchNorm1d(2), implementation="scaletrain")) is SyncBatchNorm
    # A torch SyncBatchNorm left on CPU (where it cannot train, and DDP refuses it) -> ours.
    assert type(sync_batchnorm(nn.SyncBatchNorm(2))) is SyncBatchNorm
    assert type(sync_batchnorm(nn.BatchNorm1d(2, device="meta"))) is SyncBatchNorm
    no_tensors = nn.BatchNorm1d(2, affine=False, track_running_stats=False)
    assert type(sync_batchnorm(no_tensors)) is SyncBatchNorm
    with pytest.raises(ConfigError, match=r"implementation='cuda'.*auto, torch, scaletrain"):
        sync_batchnorm(nn.BatchNorm1d(2), implementation="cuda")  # type: ignore[arg-type]


def test_auto_picks_torch_for_layers_on_devices_its_kernels_support(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No GPU here: pretend "meta" is such a device to exercise the rule itself.
    monkeypatch.setattr(sbn, "_torch_sync_bn_devices", lambda: frozenset({"meta"}))
    model = nn.Sequential(nn.BatchNorm1d(2, device="meta"), nn.BatchNorm1d(2))
    sync_batchnorm(model)
    assert [type(m) for m in model] == [nn.SyncBatchNorm, SyncBatchNorm]


def test_lazy_layers_must_be_materialised_first() -> None:
    with pytest.raises(ConfigError, match="Run one forward pass"):
        sync_batchnorm(nn.Sequential(nn.LazyBatchNorm1d()))


# -- behaviour without a process group -------------------------------------------------


@pytest.mark.parametrize("kind", list(SHAPES))
@pytest.mark.parametrize("momentum", [0.1, None])
def test_without_process_group_equals_batchnorm_bitwise(kind: str, momentum: float | None) -> None:
    ref, ours = _pair(kind, momentum=momentum)
    for step in range(2):
        x = _input(kind, 6, torch.float32, seed=step)
        w = torch.randn_like(x)
        _assert_same(_run(ours, x, w), _run(ref, x, w))
    assert ours.state_dict().keys() == ref.state_dict().keys()
    for key, value in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key
    assert int(ours.num_batches_tracked) == 2
    ref.eval()
    ours.eval()
    x = _input(kind, 4, torch.float32, seed=9)
    w = torch.randn_like(x)
    _assert_same(_run(ours, x, w), _run(ref, x, w))


def test_group_of_one_rank_equals_batchnorm_bitwise() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ref, ours = _pair("NCHW")
        x = _input("NCHW", 5, torch.float32, seed=1)
        w = torch.randn_like(x)
        _assert_same(_run(ours, x, w), _run(ref, x, w))
        assert torch.equal(ours.running_var, ref.running_var)
    finally:
        dist.destroy_process_group()


def test_eval_without_running_stats_uses_the_local_batch() -> None:
    ref, ours = _pair("NCL", track_running_stats=False)
    ref.eval()
    ours.eval()
    x = _input("NCL", 4, torch.float32, seed=2)
    w = torch.randn_like(x)
    _assert_same(_run(ours, x, w), _run(ref, x, w))


def test_input_checks() -> None:
    bn = SyncBatchNorm(C)
    with pytest.raises(ValueError, match=r"at least 2 dimensions, got 1-D"):
        bn(torch.randn(C))
    with pytest.raises(ValueError, match=r"with 4 channels in dimension 1; expected 3"):
        bn(torch.randn(2, 4))


# -- the synchronised maths, on the local batch (group=None skips the collectives) ------


def _function(bn: SyncBatchNorm, x: torch.Tensor, group: Any = None) -> torch.Tensor:
    factor = bn.momentum if bn.momentum is not None else 1.0
    out: torch.Tensor = sbn._SyncBatchNormFunction.apply(
        x, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.eps, factor, group
    )
    return out


class _Fn(nn.Module):
    """The autograd Function behind a module, so _run can drive it."""

    def __init__(self, bn: SyncBatchNorm, group: Any = None) -> None:
        super().__init__()
        self.bn = bn
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _function(self.bn, x, self.group)


@pytest.mark.parametrize("kind", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_function_equals_batchnorm(kind: str, dtype: torch.dtype) -> None:
    ref, ours = _pair(kind, dtype=dtype)
    fn = _Fn(ours)
    # float32: BatchNorm's kernels and ours round differently (Welford vs float64 sums);
    # measured differences are < 2e-7 relative. float64: ~1e-15.
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    for step in range(2):
        x = _input(kind, 7, dtype, seed=step)
        w = torch.randn_like(x)
        got = {k.replace("bn.", ""): v for k, v in _run(fn, x, w).items()}
        _assert_same(got, _run(ref, x, w), **tol)
    torch.testing.assert_close(ours.running_mean, ref.running_mean, **tol)
    torch.testing.assert_close(ours.running_var, ref.running_var, **tol)


def test_function_gradcheck() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(2, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    b = torch.randn(2, generator=g, dtype=torch.float64, requires_grad=True)
    fn = sbn._SyncBatchNormFunction.apply
    affine = lambda x, w, b: fn(x, w, b, None, None, 1e-5, 0.1, None)  # noqa: E731
    assert torch.autograd.gradcheck(affine, (x, w, b))
    assert torch.autograd.gradcheck(lambda x: fn(x, None, None, None, None, 1e-5, 0.1, None), (x,))


def test_one_value_per_channel_is_refused() -> None:
    with pytest.raises(ValueError, match=r"more than 1 value per channel.*got 1 over the whole"):
        _function(SyncBatchNorm(C), torch.randn(1, C))


def test_fake_two_identical_ranks_one_collective_each_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An all-reduce that doubles its tensor is two ranks holding the same batch."""
    calls: list[tuple[int, torch.dtype]] = []

    def fake_all_reduce(t: torch.Tensor, op: Any = None, group: Any = None) -> None:
        calls.append((t.numel(), t.dtype))
        t.mul_(2)

    monkeypatch.setattr(sbn.dist, "all_reduce", fake_all_reduce)
    monkeypatch.setattr(SyncBatchNorm, "_group", lambda self: "two-ranks")
    ref, ours = _pair("NCHW", dtype=torch.float64, momentum=None)
    x = _input("NCHW", 3, torch.float64, seed=4)
    w = torch.randn_like(x)
    got = _run(ours, x, w)
    # The global batch is x twice; F = both ranks' losses = the loss on [x, x] with [w, w].
    want = _run(ref, torch.cat([x, x]), torch.cat([w, w]))
    tol = {"rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(got["y"], want["y"][:3], **tol)
    torch.testing.assert_close(got["grad_x"], want["grad_x"][:3], **tol)
    # Weight and bias gradients are this rank's local half.
    torch.testing.assert_close(got["grad_weight"] * 2, want["grad_weight"], **tol)
    torch.testing.assert_close(got["grad_bias"] * 2, want["grad_bias"], **tol)
    torch.testing.assert_close(ours.running_var, ref.running_var, **tol)
    assert calls == [(2 * C + 1, torch.float64), (2 * C, torch.float64)]
    ours.eval()
    ours(x)
    assert len(calls) == 2, "eval mode must not communicate"


def test_backward_skips_the_collective_when_the_input_needs_no_gradient(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(sbn.dist, "all_reduce", lambda t, op=None, group=None: calls.append(1))
    monkeypatch.setattr(SyncBatchNorm, "_group", lambda self: "two-ranks")
    bn = SyncBatchNorm(C)
    bn(_input("NC", 4, torch.float32, seed=0)).sum().backward()
    assert len(calls) == 1 and bn.weight.grad is not None


@pytest.mark.gpu
def test_cuda_layers_get_torch_sync_batchnorm_and_ours_matches_on_cuda() -> None:
    model = nn.Sequential(nn.BatchNorm2d(C)).cuda()
    assert type(sync_batchnorm(model)[0]) is nn.SyncBatchNorm
    ref, ours = _pair("NCHW")
    ref.cuda()
    fn = _Fn(ours.cuda())
    x = _input("NCHW", 6, torch.float32, seed=0).cuda()
    w = torch.randn_like(x)
    got = {k.replace("bn.", ""): v for k, v in _run(fn, x, w).items()}
    _assert_same(got, _run(ref, x, w), rtol=1e-5, atol=1e-5)


def test_builds_on_a_torch_whose_batchnorm_has_no_bias_argument(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch before 2.13 (2.11 on a GPU machine here): BatchNorm takes no `bias`, and
    passing it raised TypeError in every SyncBatchNorm."""
    original = _BatchNorm.__init__

    def old_init(  # the torch 2.11 signature
        self: _BatchNorm, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
        affine: bool = True, track_running_stats: bool = True, device: Any = None,
        dtype: Any = None,
    ) -> None:  # fmt: skip
        original(self, num_features, eps, momentum, affine, track_running_stats,
                 device=device, dtype=dtype)  # fmt: skip

    monkeypatch.setattr(_BatchNorm, "__init__", old_init)
    bn = SyncBatchNorm(C)
    assert bn.weight is not None and bn.bias is not None
    no_bias = SyncBatchNorm(C, bias=False)
    assert no_bias.weight is not None and no_bias.bias is None
    x = torch.randn(4, C, 5)
    ref = nn.BatchNorm1d(C)
    ref.load_state_dict(bn.state_dict())
    torch.testing.assert_close(bn(x), ref(x))
