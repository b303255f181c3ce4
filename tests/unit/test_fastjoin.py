"""The rendezvous patches of launch/fastjoin.py: the same names, no join jitter on one node."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as torch_rdzv

from scaletrain.launch.fastjoin import fast_rendezvous, frame_name


def _outer() -> tuple[str, str]:
    return _inner()


def _inner() -> tuple[str, str]:
    return frame_name(), torch_rdzv.get_method_name()


def test_frame_name_is_what_torch_computes_with_inspect() -> None:
    # torch's get_method_name(depth=2) names the caller of the function that calls it.
    assert _outer() == ("_outer", "_outer")
    here = inspect.stack()[0].function
    assert frame_name(1) == here == "test_frame_name_is_what_torch_computes_with_inspect"
    assert frame_name(10_000) == "no_method_name"


@pytest.mark.parametrize("single_node", [True, False])
def test_patched_for_one_launch_and_restored(
    single_node: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    slept: list[Any] = []
    monkeypatch.setattr(torch_rdzv, "_delay", lambda seconds: slept.append(seconds))
    original_name, original_delay = torch_rdzv.get_method_name, torch_rdzv._delay
    with fast_rendezvous(single_node=single_node):
        assert torch_rdzv.get_method_name is frame_name
        torch_rdzv._delay(seconds=(0, 0.3))  # the join jitter
        torch_rdzv._delay(seconds=1)  # a poll interval
    # The poll interval is always slept; the jitter only where several nodes join.
    assert slept == ([1] if single_node else [(0, 0.3), 1])
    assert torch_rdzv.get_method_name is original_name
    assert torch_rdzv._delay is original_delay
