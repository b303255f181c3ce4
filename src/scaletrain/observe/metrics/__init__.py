"""The step ledger: where every rank's time goes, and what it costs.

- `phases`: the names of a step's phases (part of the on-disk format).
- `clocks`: wall-clock and CUDA-event timelines of the phase switches.
- `ledger`: the state machine the hooks drive (`switching`: its phases and the hooks'
  entry points); `hooks` puts it on a model, a loader and an optimizer, `attach` gives a
  Runtime its ledger.
- `series`, `window`: a window's per-step numbers and the one all-gather that shares
  them; `stragglers` names the rank that holds the job back; `runqueue` reads how long
  a thread waited for a CPU.
- `flops` (MFU), `memory` (peaks, GPU utilisation).
- `records`: the ledger on disk (RUN/observe/), a writer and a reader; `summary`: the
  whole run in one table and summary.json.
- `profiling`, `overlap`: a torch.profiler window and the overlap read from its traces.
- `ledger_observer`: the ledger told what its hooks cannot see by `scaletrain train`.
"""

__all__: list[str] = []
