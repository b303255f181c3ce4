"""What `scaletrain train` trains: a model, its data, its loss and optimizer (a Recipe).

A Recipe is the one form every model takes: the seeds' recipes (`--recipe convnet`)
are Recipes defined here, and a user's own model (`--model MODULE:NAME`) becomes one
through `load_recipe`, which reads the small protocol below from the user's module.
The run (Session) knows Recipes only, so everything it does (resume, extend, fork,
preemption, the ledger, plans) works for either.

A Hugging Face config.json (`--model path/config.json`) becomes one too: its causal
language model, pretrained from random initialisation (`scaletrain.train.hf_config`).

The protocol, for `--model MODULE:NAME` (MODULE a dotted module importable from the
working directory, or a path to a .py file):

    NAME            a factory: NAME() -> nn.Module (built on the CPU; the strategy
                    places it). Or an object (a class, a module, a namespace) with
                    the functions below as attributes, `build` among them.
    datasets(split, data_dir=None) -> Dataset of (inputs, targets) pairs, split being
                    "train" or "test" (or --data MODULE:NAME naming such a function)
    loss(outputs, targets) -> scalar tensor            default: cross-entropy over the
                    last dimension of `outputs` (or `outputs.logits`, as Hugging Face
                    models return), targets of -100 ignored. A loss with a `num_items`
                    parameter returns its sum over the batch divided by num_items, the
                    count of targets in the whole step (every micro-batch, every rank),
                    as transformers' num_items_in_batch: the gradient is then the whole
                    batch's however the padding falls. The default loss does that for
                    task "language-model".
    optimizer(params, lr) -> torch.optim.Optimizer     default: AdamW(weight_decay=0.01)
    metrics(outputs, targets) -> {"loss_sum", "correct", "count"}: sums over the batch
                    for evaluation; default: the loss summed and argmax accuracy, over
                    the targets that are not -100
    example(batch_size) -> (inputs, targets)           for `scaletrain plan`; default:
                    the first samples of datasets("train")
    lr, batch_size, eval_batch_size, epochs, warmup, task   plain values overriding the
                    defaults (1e-3, 32, the batch size, 1, 0, "classification"; task
                    "language-model" names evaluation's accuracy "next-token acc")

Each of them is looked up on NAME's object first, then on MODULE. The learning rate a
model module gives is used as it is (no scaling with the global batch, which the
seeds' recipes apply: they were tuned at one batch size).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from scaletrain.errors import ConfigError, DatasetError, spell, unknown
from scaletrain.train.loop import cross_entropy_sums, logits_of
from scaletrain.train.models import (
    GPT,
    LLAMA_SHAPES,
    ConvNet,
    GPTConfig,
    Llama,
    SplitNet,
    WideResNet,
)

__all__ = [
    "RECIPES",
    "Recipe",
    "get_recipe",
    "logits_of",
    "recipe_for",
]


def _fashion_mnist(data_dir: str | None, split: str) -> Any:
    from scaletrain.data import load_dataset

    return load_dataset("fashion-mnist", data_dir, split=split)


def _fashion_mnist_locate(data_dir: str | None) -> str | None:
    from scaletrain.data import find_dataset_dir

    return str(find_dataset_dir("fashion-mnist", data_dir))


def _teacher(data_dir: str | None, split: str) -> Any:
    from scaletrain.data.synthetic import teacher_dataset

    return teacher_dataset(split)


def _python_text(data_dir: str | None, split: str, *, block_size: int) -> Any:
    from scaletrain.data.text import load_python_corpus

    return load_python_corpus(split, block_size=block_size, root=data_dir)


def _python_text_locate(data_dir: str | None) -> str | None:
    from scaletrain.data.text import python_corpus_root

    return str(python_corpus_root(data_dir))


def _generated(data_dir: str | None) -> str | None:
    if data_dir is not None:
        raise DatasetError(
            f"{spell('data_dir', data_dir)}: the split-net recipe generates its data (a fixed "
            f"random teacher network), so it reads no files. Fix: leave out "
            f"{spell('data_dir')}, or pick a recipe that reads files (convnet, wrn, gpt, llama)."
        )
    return None


_GPT = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)


def _images(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))


def _features(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, 10), torch.randint(0, 5, (batch,))


def _tokens(batch: int, *, vocab: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab, (batch, seq + 1))
    return tokens[:, :-1], tokens[:, 1:]


_LLAMA_SEQ = {"debug": 64, "1b": 2048, "8b": 8192}
"""Tokens per training sequence of each llama recipe: the gpt recipe's at the debug
size, and 2,048 / 8,192 for 1B / 8B (torchtitan's Llama 3.1 8B runs use 8,192)."""


def _llama(size: str) -> Llama:
    return Llama(LLAMA_SHAPES[size])


def _llama_recipe(size: str, name: str, **settings: Any) -> Recipe:
    shape, seq = LLAMA_SHAPES[size], _LLAMA_SEQ[size]
    return Recipe(
        name=name,
        dataset="python sources (byte-level)",
        build=partial(_llama, size),
        data=partial(_python_text, block_size=seq),
        locate_data=_python_text_locate,
        example=partial(_tokens, vocab=shape.vocab_size, seq=seq),
        optimizer_name="adamw",
        betas=(0.9, 0.95),
        weight_decay=0.1,
        epochs=1,
        task="language-model",
        **settings,
    )


@dataclass(kw_only=True, frozen=True, slots=True)
class Recipe:
    """A model, the data it trains on, and optimiser settings that work for it."""

    name: str
    """Name given to `scaletrain train --recipe`, or the run's name for a model module."""
    dataset: str
    """What the data is, for messages ("fashion-mnist", "python sources")."""
    build: Callable[[], nn.Module]
    """Builds the model (on CPU; the strategy places it)."""
    data: Callable[[str | None, str], Any]
    """(data_dir, split) -> Dataset of (input, target) pairs."""
    locate_data: Callable[[str | None], str | None] = _generated
    """(data_dir) -> the directory the data is read from (for the run header and
    config.json), None for data generated in memory; raises DatasetError before any
    process starts if it is not there."""
    example: Callable[[int], tuple[torch.Tensor, torch.Tensor]] = _images
    """batch size -> random (inputs, targets) shaped like the data (for scaletrain plan)."""
    lr: float
    """Peak learning rate at `reference_batch`; scaled linearly with the global batch."""
    optimizer_name: str = "sgd"
    """"sgd" (Nesterov momentum) or "adamw"."""
    momentum: float = 0.9
    """SGD momentum."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's betas."""
    weight_decay: float = 5e-4
    """Weight decay."""
    reference_batch: int | None = 200
    """Global batch size at which `lr` was tuned; None: `lr` is used at any batch."""
    epochs: int = 2
    """Default passes over the data."""
    warmup: int = 100
    """Steps of linear learning-rate warm-up (a count, not a fraction: short runs too
    start gently)."""
    batch_size: int = 100
    """Default samples per rank per step."""
    eval_batch_size: int = 1000
    """Samples per rank per evaluation step."""
    sync_bn: bool = False
    """Convert BatchNorm to SyncBatchNorm by default (the seeds' WideResNet example)."""
    task: str = "classification"
    """"classification" (accuracy) or "language-model" (next-token accuracy, loss)."""
    spec: str | None = None
    """Where a model module's recipe came from (`--model MODULE:NAME`); None for the
    seeds' recipes."""
    loss_fn: Callable[..., torch.Tensor] | None = None
    """The module's loss(outputs, targets); None: cross-entropy (see `loss`)."""
    optimizer_fn: Callable[..., torch.optim.Optimizer] | None = None
    """The module's optimizer(params, lr); None: by `optimizer_name`."""
    metrics_fn: Callable[[Any, torch.Tensor], Any] | None = None
    """The module's metrics(outputs, targets); None: see `eval_sums`."""
    token_loss: bool = False
    """Normalise the loss by the step's count of targets over every micro-batch and
    rank (scaletrain.train.loop.train_step), not per micro-batch and rank: a model
    module's language model, or one whose loss takes num_items."""

    def loss(
        self, outputs: Any, targets: torch.Tensor, *, num_items: int | None = None
    ) -> torch.Tensor:
        """The module's loss, else cross-entropy over the last dimension (sequence
        outputs (B, T, V) flattened to tokens; targets of -100 ignored): the mean, or
        with `num_items` the sum over this batch divided by it. The cross-entropy is
        taken in fp32 under every strategy: autocast computes it so, and a sharded
        FSDP step, which runs without autocast, hands it bf16 logits."""
        if self.loss_fn is not None:
            if num_items is None:
                return self.loss_fn(outputs, targets)
            return self.loss_fn(outputs, targets, num_items=num_items)
        logits = logits_of(outputs)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        flat, y = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        if num_items is None:
            return nn.functional.cross_entropy(flat, y)
        return nn.functional.cross_entropy(flat, y, reduction="sum") / num_items

    def eval_sums(self, outputs: Any, targets: torch.Tensor) -> tuple[torch.Tensor, Any, Any]:
        """(loss summed, correct predictions, targets counted) over one batch, which
        evaluation adds up over every rank: the module's metrics(), else cross-entropy
        and argmax accuracy over the targets that are not -100."""
        if self.metrics_fn is not None:
            got = self.metrics_fn(outputs, targets)
            missing = {"loss_sum", "correct", "count"} - set(got or {})
            if missing:
                raise ConfigError(
                    f"{self.spec}: metrics(outputs, targets) returned {got!r}; expected a dict "
                    f"with loss_sum, correct and count (sums over the batch), missing "
                    f"{', '.join(sorted(missing))}."
                )
            return got["loss_sum"], got["correct"], got["count"]
        return cross_entropy_sums(outputs, targets)

    def optimizer(self, params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
        if self.optimizer_fn is not None:
            return self.optimizer_fn(params, lr)
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(
                params, lr=lr, betas=self.betas, weight_decay=self.weight_decay
            )
        return torch.optim.SGD(
            params, lr=lr, momentum=self.momentum, nesterov=True, weight_decay=self.weight_decay
        )

    def scaled_lr(self, global_batch: int) -> float:
        """Linear scaling rule (Goyal et al.): the same recipe at another world size
        (a model module's lr is used as it is: reference_batch None)."""
        if self.reference_batch is None:
            return self.lr
        return self.lr * global_batch / self.reference_batch


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            name="convnet",
            dataset="fashion-mnist",
            build=ConvNet,
            data=_fashion_mnist,
            locate_data=_fashion_mnist_locate,
            lr=0.1,
        ),
        Recipe(
            name="split-net",
            dataset="teacher (synthetic, 10 features -> 5 classes)",
            build=SplitNet,
            data=_teacher,
            example=_features,
            lr=0.2,
            epochs=3,
            warmup=30,
            weight_decay=0.0,
        ),
        Recipe(
            name="wrn",
            dataset="fashion-mnist",
            build=partial(WideResNet, depth=10, width=1),
            data=_fashion_mnist,
            locate_data=_fashion_mnist_locate,
            lr=0.1,
            epochs=1,
            sync_bn=True,
            eval_batch_size=500,
        ),
        Recipe(
            name="gpt",
            dataset="python sources (byte-level)",
            build=partial(GPT, _GPT),
            data=partial(_python_text, block_size=_GPT.block_size),
            locate_data=_python_text_locate,
            example=partial(_tokens, vocab=_GPT.vocab_size, seq=_GPT.block_size),
            lr=1e-3,
            optimizer_name="adamw",
            weight_decay=0.01,
            reference_batch=64,
            epochs=1,
            batch_size=32,
            eval_batch_size=64,
            task="language-model",
        ),
        # Llama-shaped (RMSNorm, rotary embeddings, SwiGLU, grouped-query attention) on
        # the gpt recipe's bytes, with torchtitan's AdamW (betas 0.9 / 0.95, decay 0.1).
        # 1B and 8B read the same bytes through a 128,256-token vocabulary: they are for
        # plans and GPUs (throughput, memory), at a learning rate used as it is.
        _llama_recipe(
            "debug",
            "llama",
            lr=2e-3,
            reference_batch=64,
            warmup=100,
            batch_size=32,
            eval_batch_size=64,
        ),
        _llama_recipe(
            "1b",
            "llama-1b",
            lr=3e-4,
            reference_batch=None,
            warmup=100,
            batch_size=4,
            eval_batch_size=4,
        ),
        _llama_recipe(
            "8b",
            "llama-8b",
            lr=3e-4,
            reference_batch=None,
            warmup=200,
            batch_size=1,
            eval_batch_size=1,
        ),
    )
}


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ConfigError(unknown("recipe", name, sorted(RECIPES)), field="recipe")
    return RECIPES[name]


def recipe_for(config: Any) -> Recipe:
    """The Recipe a TrainConfig asks for: its --model (and --data), else its recipe."""
    if config.model is not None:
        from scaletrain.train.model_module import load_recipe

        return load_recipe(config.model, data=config.data)
    return get_recipe(config.resolved_recipe())
