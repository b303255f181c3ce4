"""The namespace hosts themselves: a network works beside what a killed session left.

A session killed before its teardown leaves its bridge and subnet behind, and pids
repeat, so the next session's first choice of name or subnet can be taken. Both
cases below failed before the network claimed free ones: a second bridge on the
same subnet made the kernel answer the hosts through the first, and the Slurm
fixture's slurmd never reached slurmctld ("Unable to contact slurm controller").
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest

from tests.cluster.netns import Network, netns_available

pytestmark = [pytest.mark.timeout(60)]


@pytest.fixture
def leaked(tmp_path: Path) -> Iterator[Network]:
    """A network with a host, standing in for one a killed session left behind."""
    reason = netns_available()
    if reason:
        pytest.skip(reason)
    with Network(tmp_path) as net:
        net.add_host("old1")
        yield net


@pytest.mark.parametrize("pid_offset", [0, 200], ids=["same-name", "same-subnet"])
def test_a_network_beside_a_leaked_one_reaches_its_gateway(
    leaked: Network, tmp_path: Path, pid_offset: int
) -> None:
    # The same serial and a pid 200 apart give the same first subnet under another
    # name; the same pid gives the same name as well.
    with (
        mock.patch.object(Network, "_made", Network._made - 1),
        mock.patch("os.getpid", return_value=os.getpid() + pid_offset),
    ):
        fresh = Network(tmp_path)
    with fresh, socket.socket() as server:
        host = fresh.add_host("new1")
        server.bind((fresh.gateway, 0))
        server.listen()
        port = server.getsockname()[1]
        connect = f"import socket; socket.create_connection(({fresh.gateway!r}, {port}), 5)"
        got = subprocess.run(
            host.command([sys.executable, "-c", connect]),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert got.returncode == 0, got.stderr[-2000:]
    assert fresh.bridge != leaked.bridge
    assert fresh.subnet != leaked.subnet
