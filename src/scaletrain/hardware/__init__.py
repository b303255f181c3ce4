"""What the devices a job runs on can do: one table for the planner and the ledger.

A `Hardware` is a node type: its devices' memory, their matmul FLOP/s by dtype (the
datasheet's dense peak, and what a training step's matmuls achieve), the bandwidth
their elementwise kernels reach, the time one kernel launch costs, two links
(between the devices of a node, and between nodes) as alpha-beta models, and a GPU's
share of its host (where CPU offload keeps its state). The shipped
profiles are TOML files in this package, each naming its sources; `scaletrain plan
--calibrate FILE` measures this machine and writes one; `--hardware NAME|FILE`
reads one (`load`). The datasheet peaks are one table, devices.toml: the profiles
name their device's entry, and the ledger's MFU reads it too (`datasheet_peak`), so
a plan's MFU and a run's are one number.

Dtype names are the matmul dtypes: "fp32", "tf32", "bf16", "fp16", "fp8".

This package imports nothing of scaletrain but its errors: everything may read it.
"""

from __future__ import annotations

from scaletrain.hardware.datasheet import Datasheet, datasheet, datasheet_peak, datasheets
from scaletrain.hardware.files import load, shipped
from scaletrain.hardware.spec import COLLECTIVES, DTYPES, Hardware, Host, Link, bus_factor
from scaletrain.hardware.writing import write

__all__ = [
    "COLLECTIVES",
    "DTYPES",
    "Datasheet",
    "Hardware",
    "Host",
    "Link",
    "bus_factor",
    "datasheet",
    "datasheet_peak",
    "datasheets",
    "load",
    "shipped",
    "write",
]
