"""How long a run is, in steps and epochs, from the config and where a resume stands.

A new run has `epochs x steps_per_epoch` steps (or `max_steps`, if fewer), epoch e
spanning steps e*spe .. (e+1)*spe. A resumed run recomputes its length from the
config it is given now (so it may be extended or shortened) and starts in the epoch
its loader was saved in: at the same data-parallel size that epoch ends where it
always would; at another, after however many steps its remaining samples make, and
the epochs after it are whole again.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RunLength"]


@dataclass(frozen=True, slots=True)
class RunLength:
    """The run's steps and epochs: its first epoch may be the rest of a resumed one."""

    steps_per_epoch: int
    first_epoch: int
    """The epoch the run (or the resume) starts in."""
    first_epoch_end: int
    """The step at which that epoch ends (one epoch's steps for a new run)."""
    total_steps: int

    @classmethod
    def plan(
        cls,
        *,
        steps_per_epoch: int,
        epochs: int,
        max_steps: int | None,
        step: int = 0,
        loader_epoch: int = 0,
        steps_left_in_epoch: int | None = None,
    ) -> RunLength:
        """`steps_left_in_epoch`: after a resume at `step`, the steps the loader's epoch
        `loader_epoch` still has (0: it is done, the next one starts); None: a new run."""
        spe = steps_per_epoch
        if steps_left_in_epoch is None:
            first, end = 0, spe
        elif steps_left_in_epoch > 0:
            first, end = loader_epoch, step + steps_left_in_epoch
        else:
            first, end = loader_epoch + 1, step + spe
        by_epochs = end + (epochs - first - 1) * spe
        total = min(by_epochs, max_steps) if max_steps is not None else by_epochs
        return cls(spe, first, end, max(total, 0))

    def epoch_of(self, step: int) -> int:
        """The epoch that step `step` (0-based) belongs to."""
        if step < self.first_epoch_end:
            return self.first_epoch
        return self.first_epoch + 1 + (step - self.first_epoch_end) // self.steps_per_epoch

    def span(self, epoch: int) -> tuple[int, int]:
        """(first step, end step) of `epoch`; the end capped at the run's last step."""
        if epoch == self.first_epoch:
            first = max(self.first_epoch_end - self.steps_per_epoch, 0)
            end = self.first_epoch_end
        else:
            first = self.first_epoch_end + (epoch - self.first_epoch - 1) * self.steps_per_epoch
            end = first + self.steps_per_epoch
        return first, min(end, self.total_steps)

    def epoch_end(self, epoch: int) -> int:
        """The step at which `epoch` ends, not capped at the run's length."""
        if epoch == self.first_epoch:
            return self.first_epoch_end
        return self.first_epoch_end + (epoch - self.first_epoch) * self.steps_per_epoch

    def at_checkpoint(self, step: int) -> dict[str, int]:
        """What a checkpoint at `step` records of the run's length, so that a later start
        can plan its length from the checkpoint alone (`resumed_total`)."""
        epoch = self.epoch_of(max(step - 1, 0))
        return {
            "steps_per_epoch": self.steps_per_epoch,
            "epoch": epoch,
            "epoch_end": self.epoch_end(epoch),
        }

    @staticmethod
    def resumed_total(
        saved: dict[str, int], *, step: int, epochs: int, max_steps: int | None
    ) -> int:
        """The length a resume at `step` plans (as `plan` does with the loader's
        position), from what `at_checkpoint` recorded; the same data-parallel size."""
        spe, epoch, end = saved["steps_per_epoch"], saved["epoch"], saved["epoch_end"]
        if step >= end:
            epoch, end = epoch + 1, step + spe
        by_epochs = end + (epochs - epoch - 1) * spe
        total = min(by_epochs, max_steps) if max_steps is not None else by_epochs
        return max(total, 0)

    @property
    def epochs(self) -> int:
        """Epochs the run touches, counting from epoch 0."""
        return self.epoch_of(self.total_steps - 1) + 1 if self.total_steps else 1
