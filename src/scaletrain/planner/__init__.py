"""`scaletrain plan`: what a job needs and which layout runs it fastest, on paper.

Three inputs: the model's profile (profile.py: sizes, FLOPs and activation memory
from one fake forward and backward), a layout (layout.py: dp x tp x pp, the ZeRO
stage, the pipeline's schedule and microbatches) and a hardware file
(scaletrain.hardware). cost.py turns them into `memory(...)` and `step_time(...)`,
one formula per strategy family; schedule.py simulates a pipeline's step; api.py
makes every layout of N devices into a `Plan`; check.py sets a finished run beside
its plan; calibrate.py measures this machine into a hardware file (the only code
here that starts processes); models.py resolves what `--model` names.
"""

__all__: list[str] = []
