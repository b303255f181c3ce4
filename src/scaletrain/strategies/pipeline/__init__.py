"""Pipeline parallel: the model cut into stages, one (or more) per rank, fed microbatches.

Built on `torch.distributed.pipelining`: its tracer (`pipeline()`, torch.export
underneath) cuts the user's unchanged model before the named submodules, and its
schedules (GPipe, 1F1B, Interleaved 1F1B) run the microbatches through the stages.

Why the stages are built lazily, at the first `forward_backward`/`predict`: the
tracer needs an example microbatch, and `rt.setup(model, optimizer)` has none. So
`setup()` returns a `PipelineModule` that holds the full model, and the optimizer
comes back as the same object. At the first batch the model is traced, this rank's
stage(s) are built, and the optimizer's param_groups are rewritten in place to this
rank's stage parameters (the tracer keeps the user's parameter objects, it does not
copy them, so the optimizer needs no rebuild and LR schedulers built on it keep
working).

Shapes: a traced stage has the microbatch shape baked in (torch.export specialises
the batch dimension, e.g. a `reshape(2, -1)` in ConvNet), and the train/eval mode
too (BatchNorm). A new input shape or mode therefore builds another set of stages
(about a second per trace), cached per (shape, dtype, mode): a smaller last training
batch just costs one extra trace, as long as it still divides into `microbatches`
equal parts (else a ConfigError says so; use `drop_last=True` in training loaders).
`predict` takes any batch size: it pads the batch (repeating its last sample) up to
the microbatch size it already traced when the batch fits, else to the next multiple
of `microbatches`, and slices the padding off the outputs.

Losses: `loss_fn(outputs, targets)` runs on the last stage once per microbatch and
should average over its microbatch (as cross_entropy does); the step's gradient is
then the batch mean's, and the returned loss (the same on every pipeline rank) is the
mean over microbatches, which equals the batch mean for equal microbatches. A model
with batch-coupled layers (BatchNorm) sees microbatches, as under gradient
accumulation; evaluate in eval() mode, where padding rows cannot leak into the
real ones.

Scope: this strategy spans the "pp" dimension only. With a mesh that also has "dp",
`data_parallel` hands all stages of a replica the same shard, and averaging the
stage gradients over "dp" is the composing strategy's job (strategies/mesh.py).

What each rank's full model holds: every rank keeps the whole user model (`rt.unwrap`),
but trains only the parameters of its own stage(s); the other stages' tensors stay at
their initial values on that rank. `PipelineModule.stage_state_dict()` gives this
rank's share under the full model's names; the union over the pipeline ranks is the
trained model's state dict.
"""

from scaletrain.strategies.partition import balance_stages
from scaletrain.strategies.pipeline.module import PipelineModule
from scaletrain.strategies.pipeline.strategy import SCHEDULES, Pipeline, pipeline_layers

__all__ = ["SCHEDULES", "Pipeline", "PipelineModule", "balance_stages", "pipeline_layers"]
