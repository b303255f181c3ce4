"""The one-line refusals of a step the profile cannot run: what fake tensors cannot
compute (an op whose result depends on values, a custom op without a fake kernel,
.numpy()), and an error the user's own code raised, told by their file and line."""

from __future__ import annotations

import contextlib
import logging
import traceback
from typing import Any

from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
)

from scaletrain.errors import ConfigError, ScaletrainError, say

__all__ = ["quiet_meta_failures", "refused"]


_FAKE_LIMITS = (DataDependentOutputException, DynamicOutputShapeException,
                UnsupportedOperatorException)  # fmt: skip
"""What a step fake tensors cannot run raises: an op whose result depends on values
(.nonzero(), .item()) or one with no fake kernel (a custom op registered without)."""
_NO_FAKE = "There was no fake impl registered for <CustomOpDef("
"""torch.library.custom_op's RuntimeError for an op without a fake kernel."""
_NUMPY = ".numpy() is not supported for tensor subclasses"
"""A fake tensor's RuntimeError for .numpy()."""


def _unprofiled(what: str, exc: RuntimeError) -> ConfigError | None:
    """The refusal of a step fake tensors cannot run (`_FAKE_LIMITS`, a custom op
    without a fake kernel, .numpy()), in one line; None for another error."""
    text = str(exc)
    custom = text.startswith(_NO_FAKE)
    if not (isinstance(exc, _FAKE_LIMITS) or custom or _NUMPY in text):
        return None
    op = str(getattr(exc, "func", exc)).removesuffix(".default")
    measure = say(
        api="train a few steps: the run's step ledger reports each phase's time and the "
        "peak memory",
        cli="scaletrain train --max-steps 20 reports each phase's time and the peak memory",
    )
    if isinstance(exc, UnsupportedOperatorException) or custom:
        # torch.library.custom_op names the op and the function to register it with.
        op, _, rest = text.removeprefix(_NO_FAKE).partition(")>") if custom else (op, "", "")
        how = rest.partition("Please use `")[2].partition("`")[0] or "torch.library.register_fake"
        why = (
            f"runs {op}, which has no fake-tensor kernel, and a plan runs one step on "
            f"fake tensors. Fix: register one ({how})"
        )
    else:
        shown = (
            ".item() or the like (a tensor read as a Python number or bool: .tolist(), "
            "`if tensor:`)" if "scalar_dense" in op
            else ".numpy() (a tensor read into NumPy)" if _NUMPY in text
            else op
        )  # fmt: skip
        fix = (
            "read it after the step (logging, metrics), not inside it" if _NUMPY in text
            else "compute that part from shapes alone (a mixture of experts: transformers' "
            "grouped matmuls, not a loop over the experts each token picks)"
        )  # fmt: skip
        why = (
            f"runs {shown}, whose result depends on the values of its inputs, and a plan "
            f"runs one step on fake tensors, which hold shapes but no values. Fix: {fix}"
        )
    return ConfigError(
        f"{say(api='plan(...): ', cli='')}{what} cannot be profiled: it {why}, or measure "
        f"it: {measure}.",
        field="model",
    )


def refused(what: str, exc: Exception, example: Any = None) -> ConfigError | None:
    """The refusal of a step that failed under the profile: one fake tensors cannot run
    (`_unprofiled`), or an error the user's own code raised (their file and line, as a
    model module's failing factory is shown), or a torch op's check of what the model was
    given (`example`: the batch, as a model whose data does not fit it fails: float
    features into an embedding); None for any other (scaletrain's: its traceback)."""
    from scaletrain.train.user_code import raised_in_user_code, user_code_error

    if isinstance(exc, ScaletrainError):
        return None
    if isinstance(exc, RuntimeError) and (refusal := _unprofiled(what, exc)):
        return refusal
    batch = ""
    if example is not None:
        inputs, targets = (_shown(t) for t in example)
        batch = f" on its example batch (inputs {inputs}, targets {targets})"
    if raised_in_user_code(exc):
        return user_code_error(exc, f"{say(api='plan(...): ', cli='')}{what}{batch}", "model")
    if batch and isinstance(exc, (RuntimeError, TypeError, IndexError)) and not _ours(exc):
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return ConfigError(
            f"{say(api='plan(...): ', cli='')}{what} failed{batch}: {type(exc).__name__}: "
            f"{first}. Fix: if that batch is not what the model's forward takes, the model "
            "module's example(batch_size) or datasets(split) (a model of token ids takes "
            "int64 ids): training would fail the same way; if it is, the op failed under "
            "the plan's fake tensors: measure instead (train a few steps).",
            field="model",
        )
    return None


def _ours(exc: BaseException) -> bool:
    """Whether scaletrain's own code raised `exc` (its innermost frame): a bug of ours
    beneath the forward, not what the model was given."""
    frames = list(traceback.walk_tb(exc.__traceback__))
    module = str(frames[-1][0].f_globals.get("__name__", "")) if frames else ""
    return module.startswith("scaletrain.")


def _shown(value: Any) -> str:
    """float32 (1, 8): a tensor as a refusal names it; else its type."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{str(value.dtype).removeprefix('torch.')} {tuple(value.shape)}"
    return type(value).__name__


@contextlib.contextmanager
def quiet_meta_failures() -> Any:
    """torch's fake-tensor mode logs each op whose meta kernel raised, traceback and
    all, before the error reaches the profile, which says it once (`refused`)."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)
