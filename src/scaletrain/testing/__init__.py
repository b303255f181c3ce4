"""Run a function on N real ranks, as torchrun would start them. Public: users test with it."""

from scaletrain.testing.ranks import (
    RankFailure,
    free_port,
    launcher_free_env,
    launcher_variables,
    run_ranks,
)

__all__ = ["RankFailure", "free_port", "launcher_free_env", "launcher_variables", "run_ranks"]
