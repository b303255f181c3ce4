"""`scaletrain.init()` and the Runtime it returns: the whole public training API.

core.py holds the Runtime (the methods a training loop calls), on its base classes
place.py's Place (rank, device, mesh) and collectives.py's Collectives (reduce, gather,
broadcast, any_rank, barrier; rows.py the rows the gathers send); arguments.py its checks
of a loop's loss and checkpoint arguments. start.py holds `init` (what builds it) and
`sync_batchnorm` (which reads the current one); signals.py and stopping.py how a run
stops on a signal (a stop request, then every rank's agreement on the step).
"""

from scaletrain.accumulation import AccumulationStep
from scaletrain.dist.topology import MESH_DIMS, parse_mesh
from scaletrain.observe.metrics.ledger import LedgerConfig
from scaletrain.runtime.core import Runtime, current
from scaletrain.runtime.start import init, sync_batchnorm

# MESH_DIMS and parse_mesh live in scaletrain.dist.topology; exported here too, as before.
__all__ = [
    "MESH_DIMS",
    "AccumulationStep",
    "LedgerConfig",
    "Runtime",
    "current",
    "init",
    "parse_mesh",
    "sync_batchnorm",
]
