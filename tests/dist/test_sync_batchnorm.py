"""SyncBatchNorm on 2 real Gloo ranks equals BatchNorm on the concatenated global batch.

ONE spawned job runs every check (spawning costs seconds on 2 cores); the reference
is computed here, in the test process, on the concatenation of the ranks' batches.
The ranks hold batches of DIFFERENT sizes (3 and 5, and 0 and 4).

Layer checks use the loss L_r = sum_{i in rank r} <G_i, y_i> with one fixed random
tensor G of the global batch's shape. The sum over ranks of these losses is exactly
the reference loss <G, Y> on the concatenated batch, with no 1/N factor that would
differ between a rank and the whole batch, so: each rank's input gradient is its
slice of the reference input gradient, and the weight/bias gradients summed over
ranks are the reference ones. G is random because for loss = y.sum() BatchNorm's
input gradient is identically zero, which would test nothing.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from scaletrain.testing import run_ranks

pytestmark = pytest.mark.timeout(180)

WORLD = 2
C = 3
# Per-sample shape after (N, C) for each input kind, and the BatchNorm that takes it.
SHAPES: dict[str, tuple[tuple[int, ...], type[_BatchNorm]]] = {
    "NC": ((), nn.BatchNorm1d),
    "NCL": ((5,), nn.BatchNorm1d),
    "NCHW": ((4, 3), nn.BatchNorm2d),
    "NCDHW": ((2, 3, 2), nn.BatchNorm3d),
}
# momentum=None (cumulative average) on two of the kinds.
MOMENTUM = {"NC": 0.1, "NCL": None, "NCHW": 0.3, "NCDHW": None}
DTYPES = {"f32": torch.float32, "f64": torch.float64}
SIZES = (3, 5)
EMPTY_SIZES = (0, 4)
LAYER_STEPS = 2
DDP_STEPS = 3
DDP_CASES = {
    # (batch sizes, per-rank loss): see _rank_loss for why the uneven case scales a sum.
    "uneven_scaled_sum": ((3, 5), "scaled_sum"),
    "even_mean": ((4, 4), "mean"),
}


# -- data and models, identical in the ranks and the test process ------------------------


def _global_batch(
    kind: str, step: int, dtype: torch.dtype, sizes: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global input X (mean 2, std 3) and loss weights G of one step."""
    g = torch.Generator().manual_seed(1000 * step + len(kind) + 10 * sum(sizes))
    shape = (sum(sizes), C, *SHAPES[kind][0])
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 3 + 2
    w = torch.randn(shape, generator=g, dtype=torch.float64)
    return x.to(dtype), w.to(dtype)


def _init_layer(bn: _BatchNorm) -> None:
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        bn.weight.copy_(torch.rand(C, generator=g) + 0.5)
        bn.bias.copy_(torch.randn(C, generator=g))


def _slice(rank: int, sizes: tuple[int, ...]) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _layer_steps(
    bn: nn.Module, kind: str, dtype: torch.dtype, sizes: tuple[int, ...], part: slice
) -> dict[str, Any]:
    """LAYER_STEPS training steps on `part` of each global batch; outputs and gradients."""
    steps = []
    for step in range(LAYER_STEPS):
        x_all, w_all = _global_batch(kind, step, dtype, sizes)
        x = x_all[part].clone().requires_grad_()
        y = bn(x)
        (y * w_all[part]).sum().backward()
        steps.append(
            {
                "y": y.detach(),
                "grad_x": x.grad,
                "grad_weight": bn.weight.grad.clone(),
                "grad_bias": bn.bias.grad.clone(),
            }
        )
        bn.weight.grad = bn.bias.grad = None
    return {
        "steps": steps,
        "running_mean": bn.running_mean.clone(),
        "running_var": bn.running_var.clone(),
        "num_batches_tracked": int(bn.num_batches_tracked),
    }


class _Net(nn.Module):
    """Conv -> BN2d -> ReLU -> Linear -> BN1d -> ReLU -> Linear, on (N, 2, 6, 6)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.features = nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten()
        )
        self.head = nn.Sequential(nn.Linear(144, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _net_batch(step: int, sizes: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    n = sum(sizes)
    return torch.randn(n, 2, 6, 6, generator=g) + 1, torch.randint(0, 3, (n,), generator=g)


def _rank_loss(logits: torch.Tensor, y: torch.Tensor, how: str, global_n: int) -> torch.Tensor:
    # DDP averages gradients over the W ranks, so the DDP gradient is that of
    # (1/W) sum_r L_r. With equal shards a local mean gives the global mean; with
    # uneven shards L_r = (sum of the rank's per-sample losses) * W / N does.
    if how == "mean":
        return nn.functional.cross_entropy(logits, y)
    return nn.functional.cross_entropy(logits, y, reduction="sum") * WORLD / global_n


# -- the ranks ------------------------------------------------------------------------


def _job() -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import scaletrain.dist.sync_batchnorm as sbn
    from scaletrain.dist.sync_batchnorm import SyncBatchNorm, sync_batchnorm

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    res: dict[str, Any] = {"rank": rank}

    # Count the collectives of one training step and one eval forward.
    calls: list[tuple[int, torch.dtype]] = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append((t.numel(), t.dtype))
        return real_all_reduce(t, *args, **kwargs)

    sbn.dist.all_reduce = counting_all_reduce  # type: ignore[assignment]
    bn = SyncBatchNorm(C)
    x = torch.randn(SIZES[rank], C, 4, requires_grad=True)
    (bn(x) * torch.randn(SIZES[rank], C, 4)).sum().backward()
    res["train_calls"] = list(calls)
    bn.eval()
    bn(x)
    res["eval_calls"] = len(calls) - len(res["train_calls"])
    sbn.dist.all_reduce = real_all_reduce

    # Every input kind and dtype, uneven batches; and one rank with an empty batch.
    layers: dict[tuple[str, str], Any] = {}
    for kind in SHAPES:
        for dname, dtype in DTYPES.items():
            bn = SyncBatchNorm(C, momentum=MOMENTUM[kind], dtype=dtype)
            _init_layer(bn)
            layers[kind, dname] = _layer_steps(bn, kind, dtype, SIZES, _slice(rank, SIZES))
    res["layers"] = layers
    bn = SyncBatchNorm(C, dtype=torch.float64)
    _init_layer(bn)
    res["empty"] = _layer_steps(bn, "NCHW", torch.float64, EMPTY_SIZES, _slice(rank, EMPTY_SIZES))

    # An explicit process group: one group per rank, so each rank normalises alone.
    own = [dist.new_group([r]) for r in range(WORLD)][rank]
    bn = SyncBatchNorm(C, process_group=own, dtype=torch.float64)
    _init_layer(bn)
    res["own_group"] = _layer_steps(bn, "NCHW", torch.float64, SIZES, _slice(rank, SIZES))

    # DDP around a converted conv net: accepted on CPU, equal to one process.
    res["ddp"] = {}
    for case, (sizes, how) in DDP_CASES.items():
        bare = sync_batchnorm(_Net())
        model = DDP(bare)
        opt = _optimizer(model)
        losses = []
        for step in range(DDP_STEPS):
            x_all, y_all = _net_batch(step, sizes)
            part = _slice(rank, sizes)
            loss = _rank_loss(model(x_all[part]), y_all[part], how, sum(sizes))
            opt.zero_grad()
            loss.backward()
            opt.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(float(total) / WORLD)
        norms = [m for m in bare.modules() if isinstance(m, _BatchNorm)]
        res["ddp"][case] = {
            "wrapped": type(model).__name__,
            "bn_types": sorted({f"{type(m).__module__}.{type(m).__name__}" for m in norms}),
            "losses": losses,
            "state": {k: v.detach().clone() for k, v in bare.state_dict().items()},
        }
        # A live DDP model at exit can abort the process (Gloo's thread races the
        # interpreter's shutdown, `terminate called without an active exception`): drop it
        # first.
        del model, opt, bare
        gc.collect()
    dist.destroy_process_group()
    return res


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_job, WORLD, timeout=150)


# -- the reference: one process, the concatenated batch ---------------------------------


def _reference_layer(
    kind: str,
    dtype: torch.dtype,
    sizes: tuple[int, ...],
    momentum: float | None,
    part: slice = slice(None),
) -> dict[str, Any]:
    """BatchNorm trained on `part` (default: all) of each global batch."""
    bn = SHAPES[kind][1](C, momentum=momentum, dtype=dtype)
    _init_layer(bn)
    return _layer_steps(bn, kind, dtype, sizes, part)


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # float32: reference BatchNorm (its own float32 kernels) and ours (float64 sums,
    # another summation order across ranks) agree to a few float32 ulps: the largest
    # difference measured is 1.6e-7 of the largest value, and rtol=atol=5e-7 passes.
    # float64 (measured <= 1.3e-15) shows the maths itself is exact to rounding.
    if dtype == torch.float32:
        return {"rtol": 2e-6, "atol": 2e-6}
    return {"rtol": 1e-12, "atol": 1e-12}


def _check_layer(
    got: list[dict[str, Any]], want: dict[str, Any], sizes: tuple[int, ...], dtype: torch.dtype
) -> None:
    tol = _tol(dtype)
    for step, ref in enumerate(want["steps"]):
        for rank, res in enumerate(got):
            mine = res["steps"][step]
            part = _slice(rank, sizes)
            torch.testing.assert_close(mine["y"], ref["y"][part], **tol)
            torch.testing.assert_close(mine["grad_x"], ref["grad_x"][part], **tol)
        for name in ("grad_weight", "grad_bias"):
            summed = sum(res["steps"][step][name] for res in got)
            torch.testing.assert_close(summed, ref[name], **tol)
    for res in got:
        torch.testing.assert_close(res["running_mean"], want["running_mean"], **tol)
        torch.testing.assert_close(res["running_var"], want["running_var"], **tol)
        assert res["num_batches_tracked"] == want["num_batches_tracked"] == LAYER_STEPS


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("kind", list(SHAPES))
def test_layer_equals_batchnorm_on_the_global_batch(
    results: list[dict[str, Any]], kind: str, dname: str
) -> None:
    dtype = DTYPES[dname]
    want = _reference_layer(kind, dtype, SIZES, MOMENTUM[kind])
    _check_layer([r["layers"][kind, dname] for r in results], want, SIZES, dtype)


def test_a_rank_with_an_empty_batch(results: list[dict[str, Any]]) -> None:
    want = _reference_layer("NCHW", torch.float64, EMPTY_SIZES, 0.1)
    got = [r["empty"] for r in results]
    assert got[0]["steps"][0]["y"].shape == (0, C, 4, 3)
    _check_layer(got, want, EMPTY_SIZES, torch.float64)


def test_explicit_process_group_is_used(results: list[dict[str, Any]]) -> None:
    # Each rank in a group of its own: plain BatchNorm on its own shard, no sync.
    for rank, res in enumerate(results):
        want = _reference_layer("NCHW", torch.float64, SIZES, 0.1, part=_slice(rank, SIZES))
        _check_layer([res["own_group"]], want, SIZES[rank : rank + 1], torch.float64)


def test_one_collective_forward_one_backward_none_in_eval(results: list[dict[str, Any]]) -> None:
    for res in results:
        assert res["train_calls"] == [(2 * C + 1, torch.float64), (2 * C, torch.float64)]
        assert res["eval_calls"] == 0


@pytest.mark.parametrize("case", list(DDP_CASES))
def test_ddp_conv_net_equals_one_process_on_the_global_batch(
    results: list[dict[str, Any]], case: str
) -> None:
    sizes, _ = DDP_CASES[case]
    model = _Net()
    opt = _optimizer(model)
    losses = []
    for step in range(DDP_STEPS):
        x, y = _net_batch(step, sizes)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    for res in results:
        got = res["ddp"][case]
        assert got["wrapped"] == "DistributedDataParallel"
        assert got["bn_types"] == ["scaletrain.dist.sync_batchnorm.SyncBatchNorm"]
        # float32, 3 SGD steps with momentum: DDP sums the ranks' gradients in another
        # order than one backward over the whole batch, and the statistics are float64
        # sums. Measured: losses 1.1e-7 relative; weights and running stats within
        # 8e-7 of each tensor's largest value (rtol=atol=1e-6 passes).
        assert got["losses"] == pytest.approx(losses, rel=1e-6, abs=1e-7)
        assert got["state"].keys() == model.state_dict().keys()
        for name, value in model.state_dict().items():
            torch.testing.assert_close(got["state"][name], value, rtol=5e-6, atol=1e-6)
    # Every replica holds the same weights and running statistics.
    for name, value in results[0]["ddp"][case]["state"].items():
        assert torch.equal(results[1]["ddp"][case]["state"][name], value), name
