"""`scaletrain plan`: what a job needs and which layout runs it fastest, on paper.

A model's profile (profile.py, its kernels counted by kernels.py, of what models.py
resolves `--model` to; structure.py adds its layers and plans), a layout (layout.py)
and a hardware file (scaletrain.hardware) go into cost.py's `memory` and `step_time`
(a pipeline's step simulated by schedule.py); api.py prices every layout of N
devices into a `Plan` (result.py: its rows, table and recommendation), check.py sets
a finished run beside its plan, command.py is the CLI.
"""

from scaletrain.planner.layout import Layout

__all__ = ["Layout"]
