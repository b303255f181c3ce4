"""Planning how a model is cut over devices and ranks: pure functions of the model.

A leaf package: it imports nothing from scaletrain but its errors, so every
strategy can use it and it can be tested without devices or processes.
"""

from scaletrain.plan.partition import (
    Layer,
    balance_stages,
    list_layers,
    list_units,
    split_layers,
)

__all__ = ["Layer", "balance_stages", "list_layers", "list_units", "split_layers"]
