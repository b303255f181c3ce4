"""SyncBatchNorm that also runs on CPU/Gloo, and `sync_batchnorm()` to convert a model.

BatchNorm normalises with the statistics of the batch it sees. Under data
parallelism each rank sees only its shard, so plain BatchNorm normalises with
per-rank statistics: small per-rank batches give noisy statistics, and the model
differs from the one trained on the global batch. SyncBatchNorm computes the
statistics of the global batch instead.

PyTorch's `nn.SyncBatchNorm` only runs on accelerators: on CPU it raises in train
mode ("SyncBatchNorm expected input tensor to be on GPU"), and DDP refuses to wrap
a CPU module that holds one ("SyncBatchNorm layers only work with GPU modules",
an `isinstance` check in `DistributedDataParallel._passing_sync_batchnorm_handle`).
This module's `SyncBatchNorm` is device-generic (plain tensor ops and
`torch.distributed.all_reduce`) and is not a subclass of `nn.SyncBatchNorm`, so DDP
accepts it on CPU/Gloo.

Which one `sync_batchnorm()` picks (implementation="auto"), per layer, by where
that layer's parameters and buffers live *when you convert*:

- on a device PyTorch's kernels support (cuda, xpu, hpu, the privateuse1 backend):
  `nn.SyncBatchNorm`, whose fused kernels are faster there;
- anywhere else (cpu, meta, mps, or a layer with no tensors at all): ours.

So convert after moving the model to its device (as a strategy's setup does). A
model converted on CPU and moved to CUDA afterwards keeps ours, which is still
correct on CUDA, only slower than PyTorch's fused kernels; pass
implementation="torch" or "scaletrain" to choose explicitly.

Training-mode maths (ours). Per layer and step, with C channels:

- forward: each rank packs its per-channel sum(x), sum(x**2) and its element count
  per channel into ONE float64 vector of 2C+1 numbers and all-reduces it (SUM).
  mean = S1/n and biased var = S2/n - mean**2 are then the statistics of the
  concatenated global batch, whatever each rank's batch size (0 included: such a
  rank contributes zeros and still joins the collective). The running stats get
  exactly BatchNorm's update on the global batch: the unbiased variance
  var * n/(n-1), momentum or (momentum=None) the cumulative average 1/num_batches.
- backward: each rank packs the per-channel sums of grad_output and
  grad_output * x_hat into ONE vector of 2C numbers and all-reduces it (SUM); the
  input gradient is then BatchNorm's input gradient on the global batch for the
  loss F = sum over ranks of each rank's own loss.
- cost: one all-reduce of 2C+1 float64 forward and one of 2C float64 backward per
  layer per step (a few hundred bytes for typical C: latency, not bandwidth), plus
  transient float64 copies of the layer's input (forward and backward) and of its
  output gradient (backward) while the per-channel sums are taken.

Accuracy: the sums are accumulated in float64 (float32 on mps, which has no
float64). The one-pass variance S2/n - mean**2 cancels when |mean| >> std; in
float64 its relative error is about 1e-16 * (mean/std)**2, below float32 rounding
unless |mean|/std exceeds ~1e4. The per-channel coefficients are float64 too; the
elementwise normalisation and input gradient run in the input's dtype, like
BatchNorm's own kernels.

Weight and bias gradients are each rank's LOCAL contribution (as in PyTorch's
SyncBatchNorm): the sum of grad_output * x_hat and of grad_output over the rank's
own samples. Every gradient on rank r is therefore rank r's share of dF/dtheta, and
DDP's all-reduce-and-divide gives (1/W) dF/dtheta = d/dtheta [(1/W) sum_r L_r].
That equals the gradient of the global-mean loss (1/N) sum_i l_i when

- every rank has the same batch size N/W and uses its local mean loss (the usual
  case), or
- batch sizes differ and each rank uses L_r = sum_{i in rank r} l_i * W / N with N
  the global batch size (a local mean would weight small shards' samples more).

Without DDP (no averaging), summing the weight/bias gradients over ranks gives dF/dw.

Every rank must run forward and backward through every synchronised layer in the
same order (each is a collective), as with PyTorch's SyncBatchNorm; the backward
collective is skipped, on every rank alike, when the layer's input needs no
gradient. Eval mode normalises with the running statistics and communicates nothing;
a layer without running statistics (track_running_stats=False) uses its local batch
statistics in eval mode, like PyTorch's. With no process group, or a group of one
rank, the layer is plain BatchNorm (`F.batch_norm`, bitwise equal).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from scaletrain.errors import ConfigError, article

__all__ = ["IMPLEMENTATIONS", "SyncBatchNorm", "sync_batchnorm"]

IMPLEMENTATIONS = ("auto", "torch", "scaletrain")

Implementation = Literal["auto", "torch", "scaletrain"]


def _torch_sync_bn_devices() -> frozenset[str]:
    # The device types nn.SyncBatchNorm.forward accepts in train mode (torch 2.13).
    return frozenset({"cuda", "hpu", "xpu", torch._C._get_privateuse1_backend_name()})


def _accumulation_dtype(device: torch.device) -> torch.dtype:
    # MPS has no float64; float32 sums there (the variance bound in the docstring
    # then holds with 1e-7 instead of 1e-16).
    return torch.float32 if device.type == "mps" else torch.float64


def _reduce_dims(x: Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _channel_shape(x: Tensor) -> list[int]:
    # (C,) statistics broadcast against (N, C, *) input as (1, C, 1, ...).
    return [1, x.size(1)] + [1] * (x.dim() - 2)


class _SyncBatchNormFunction(torch.autograd.Function):
    """Training-mode batch norm over the union of the group's batches.

    `group=None` skips the collectives: the same maths on the local batch only,
    which the unit tests compare with BatchNorm without a process group.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        eps: float,
        momentum: float,
        group: Any,
    ) -> Tensor:
        channels = x.size(1)
        acc = _accumulation_dtype(x.device)
        dims = _reduce_dims(x)
        x_acc = x.detach().to(acc)
        local_count = x.numel() // channels if channels else 0
        packed = torch.cat(
            [
                x_acc.sum(dims),
                x_acc.square().sum(dims),
                torch.tensor([float(local_count)], dtype=acc, device=x.device),
            ]
        )
        del x_acc
        if group is not None:
            dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        total_sum, total_sq, total_count = packed.split([channels, channels, 1])
        # Exact: counts are integers far below 2**53. Every rank gets the same value,
        # so every rank raises together below instead of stranding its peers.
        count = round(float(total_count.item()))
        if count <= 1:
            raise ValueError(
                f"SyncBatchNorm needs more than 1 value per channel in training mode, got "
                f"{count} over the whole group (this rank's input has shape {tuple(x.shape)}). "
                "Use a larger batch, or call model.eval() for inference."
            )
        mean = total_sum / count
        var = (total_sq / count - mean.square()).clamp_min(0.0)
        invstd = torch.rsqrt(var + eps)

        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                unbiased = var * (count / (count - 1))
                running_mean.copy_(running_mean.to(acc) * (1.0 - momentum) + mean * momentum)
                running_var.copy_(running_var.to(acc) * (1.0 - momentum) + unbiased * momentum)

        shape = _channel_shape(x)
        mean_x = mean.to(x.dtype).view(shape)
        invstd_x = invstd.to(x.dtype).view(shape)
        out = (x - mean_x) * invstd_x
        if weight is not None:
            out = out * weight.to(x.dtype).view(shape)
        if bias is not None:
            out = out + bias.to(x.dtype).view(shape)

        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.group = group
        ctx.count = count
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        group = ctx.group
        count: int = ctx.count
        needs = ctx.needs_input_grad
        channels = x.size(1)
        acc = mean.dtype
        dims = _reduce_dims(x)
        shape = _channel_shape(x)

        g_acc = grad_out.to(acc)
        x_hat = (x.to(acc) - mean.view(shape)) * invstd.view(shape)
        # Local sums: they are this rank's weight/bias gradients as they stand, and the
        # input gradient needs their global totals.
        sum_dy = g_acc.sum(dims)
        sum_dy_xhat = (g_acc * x_hat).sum(dims)
        del g_acc

        grad_weight = grad_bias = None
        if weight is not None and needs[1]:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        bias_dtype: torch.dtype | None = ctx.bias_dtype
        if bias_dtype is not None and needs[2]:
            grad_bias = sum_dy.to(bias_dtype)

        grad_x = None
        if needs[0]:
            packed = torch.cat([sum_dy, sum_dy_xhat])
            if group is not None:
                dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
            mean_dy, mean_dy_xhat = (packed / count).split([channels, channels])
            # d/dx of BN over the global batch:
            #   w * invstd * (g - mean(g) - x_hat * mean(g * x_hat)),
            # means over the global batch; per-channel coefficients in float64, the
            # elementwise part in the input's dtype.
            scale = invstd if weight is None else invstd * weight.to(acc)
            grad_x = (
                grad_out
                - mean_dy.to(x.dtype).view(shape)
                - x_hat.to(x.dtype) * mean_dy_xhat.to(x.dtype).view(shape)
            ) * scale.to(x.dtype).view(shape)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


def _takes_bias(init: Any) -> bool:
    """Whether this torch's BatchNorm takes `bias` (added in torch 2.13)."""
    import inspect

    try:
        return "bias" in inspect.signature(init).parameters
    except (TypeError, ValueError):
        return False


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the global batch of a process group; runs on CPU/Gloo and any device.

    A drop-in for `nn.BatchNorm1d/2d/3d` (inputs (N, C), (N, C, L), (N, C, H, W),
    (N, C, D, H, W)). `process_group=None` means the default group (WORLD), the
    data-parallel group of a pure data-parallel job; pass the "dp" mesh dimension's
    group when the job also shards the model. See the module docstring for the
    maths, the cost and the gradient convention.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
    ) -> None:
        # torch before 2.13 (2.11 on an H200 here): BatchNorm has no `bias` argument,
        # and passing it raised TypeError. Without a bias, none is registered.
        takes_bias = _takes_bias(_BatchNorm.__init__)
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device=device,
            dtype=dtype, **({"bias": bias} if takes_bias else {}),
        )  # fmt: skip
        if not takes_bias and affine and not bias:
            self.register_parameter("bias", None)
        self.process_group = process_group

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"SyncBatchNorm expects input of shape (N, C, *) with at least 2 dimensions, "
                f"got {input.dim()}-D input of shape {tuple(input.shape)}."
            )
        if input.size(1) != self.num_features:
            raise ValueError(
                f"SyncBatchNorm({self.num_features}) got input of shape {tuple(input.shape)} "
                f"with {input.size(1)} channels in dimension 1; expected {self.num_features}."
            )

    def _group(self) -> Any | None:
        """The group to synchronise over, or None when there is nobody to talk to."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        # The same bookkeeping as _BatchNorm.forward, so running stats match BatchNorm's.
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        track = not self.training or self.track_running_stats
        running_mean = self.running_mean if track else None
        running_var = self.running_var if track else None

        group = self._group() if self.training else None
        if group is None:
            return F.batch_norm(
                input,
                running_mean,
                running_var,
                self.weight,
                self.bias,
                bn_training,
                factor,
                self.eps,
            )
        out: Tensor = _SyncBatchNormFunction.apply(
            input,
            self.weight,
            self.bias,
            running_mean,
            running_var,
            self.eps,
            factor,
            group,
        )
        return out

    def extra_repr(self) -> str:
        group = "" if self.process_group is None else f", process_group={self.process_group}"
        return super().extra_repr() + group


def _layer_device(module: nn.Module) -> torch.device | None:
    for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
        return t.device
    return None


def _use_torch(module: nn.Module, implementation: Implementation) -> bool:
    if implementation != "auto":
        return implementation == "torch"
    device = _layer_device(module)
    return device is not None and device.type in _torch_sync_bn_devices()


def _convert(
    module: nn.Module, process_group: Any | None, implementation: Implementation
) -> nn.Module:
    out = module
    if isinstance(module, _BatchNorm):
        if any(isinstance(p, nn.parameter.UninitializedParameter) for p in module.parameters()):
            raise ConfigError(
                f"sync_batchnorm() got {article(type(module).__name__)} whose parameters are not "
                "initialised yet (a lazy module); expected materialised BatchNorm layers. "
                "Run one forward pass on a sample batch before converting."
            )
        cls = nn.SyncBatchNorm if _use_torch(module, implementation) else SyncBatchNorm
        new: _BatchNorm = cls(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
        )
        # Keep the very same Parameter and buffer objects: an optimizer built before the
        # conversion still updates them, and requires_grad, dtype and device carry over.
        if module.affine:
            new.weight = module.weight
            new.bias = module.bias
        new.running_mean = module.running_mean
        new.running_var = module.running_var
        new.num_batches_tracked = module.num_batches_tracked
        new.train(module.training)
        if hasattr(module, "qconfig"):
            new.qconfig = module.qconfig
        out = new
    for name, child in module.named_children():
        out.add_module(name, _convert(child, process_group, implementation))
    return out


def sync_batchnorm(
    model: nn.Module,
    process_group: Any | None = None,
    *,
    implementation: Implementation = "auto",
) -> nn.Module:
    """Replace every BatchNorm layer of `model` with a synchronised one; return the model.

    Converts every `_BatchNorm` (BatchNorm1d/2d/3d, subclasses, and an existing
    `nn.SyncBatchNorm`, e.g. one left on CPU) keeping the same weight, bias and
    running-stat tensors, eps, momentum, affine, track_running_stats and train/eval
    flag. implementation="auto" picks PyTorch's `nn.SyncBatchNorm` for layers on
    cuda/xpu/hpu/privateuse1 and scaletrain's `SyncBatchNorm` elsewhere (CPU): so
    convert after moving the model to its device. "torch" or "scaletrain" forces one.
    `process_group=None` synchronises over the default group (WORLD). Forward hooks
    on the replaced layers are not carried over (as in PyTorch's
    `convert_sync_batchnorm`). Returns a new module only when `model` itself is a
    BatchNorm layer; otherwise `model`, modified in place.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ConfigError(
            f"sync_batchnorm(implementation={implementation!r}) is not known; expected one "
            f"of {', '.join(IMPLEMENTATIONS)} ('auto' picks PyTorch's on GPUs, ours on CPU)."
        )
    return _convert(model, process_group, implementation)
