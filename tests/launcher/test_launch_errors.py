"""launch() refuses to start, in one clear paragraph, when the job cannot work.

These run in-process: every check fails before torch's launcher is called.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from scaletrain.env.base import ClusterEnv
from scaletrain.errors import LaunchError
from scaletrain.launch import LaunchConfig, launch
from scaletrain.launch.launcher import _launch_environ, _plan

LOCAL = ClusterEnv(
    kind="local", rank=0, local_rank=0, world_size=1, local_world_size=1,
    node_rank=0, num_nodes=1, master_addr="127.0.0.1", master_port=29500,
)  # fmt: skip


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def two_nodes(rank: int, endpoint: str, **kwargs: object) -> LaunchConfig:
    return LaunchConfig(
        nproc_per_node=1, nnodes="2", node_rank=rank, rdzv_endpoint=endpoint, **kwargs
    )  # type: ignore[arg-type]


def test_missing_script(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "train.py"
    with pytest.raises(LaunchError) as info:
        launch(LaunchConfig(nproc_per_node=1), str(missing))
    msg = str(info.value)
    assert str(missing) in msg and "does not exist" in msg
    assert "Expected the path of a Python training script" in msg and "-m" in msg


def test_directory_without_main(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match=r"directory without __main__\.py"):
        launch(LaunchConfig(nproc_per_node=1), str(tmp_path))


def test_missing_module() -> None:
    with pytest.raises(LaunchError) as info:
        launch(LaunchConfig(nproc_per_node=1, run_as_module=True), "no_such_pkg.train")
    msg = str(info.value)
    assert "'no_such_pkg.train'" in msg and "No module named 'no_such_pkg'" in msg
    assert "pip install -e ." in msg and "drop -m" in msg


@pytest.mark.timeout(30)
def test_port_in_use_on_node_zero(script: str) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(LaunchError) as info:
            launch(two_nodes(0, f"127.0.0.1:{port}"), script)
    msg = str(info.value)
    assert f"Port {port} on this machine is already in use" in msg
    assert "node rank 0" in msg and "must host the rendezvous store" in msg
    assert "pick a free port" in msg and f"sport = :{port}" in msg


@pytest.mark.timeout(30)
def test_unreachable_endpoint_polls_until_the_timeout(
    script: str, port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    # `port` is free: nobody listens there.
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(two_nodes(1, f"127.0.0.1:{port}", rdzv_timeout=2), script)
    elapsed = time.monotonic() - start
    assert 1.9 <= elapsed < 10
    msg = str(info.value)
    assert f"Cannot reach the rendezvous store at 127.0.0.1:{port}" in msg
    assert "after 2s" in msg and "Connection refused" in msg and "node rank 1" in msg
    assert "--node-rank 0" in msg and "firewall" in msg and "raise --rdzv-timeout" in msg
    assert (
        f"waiting up to 2s for the rendezvous store at 127.0.0.1:{port}" in capsys.readouterr().err
    )


@pytest.mark.timeout(30)
def test_unresolvable_host_fails_at_once(script: str) -> None:
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(two_nodes(1, "no-such-host.invalid:29400", rdzv_timeout=60), script)
    assert time.monotonic() - start < 20  # no polling: only the resolver's own time
    msg = str(info.value)
    assert "'no-such-host.invalid'" in msg and "does not resolve" in msg
    assert "--rdzv-endpoint" in msg and "/etc/hosts" in msg


def test_launch_environ_sets_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    before = dict(os.environ)
    cfg = LaunchConfig(nproc_per_node=2, max_restarts=1, extra_env={"SCALETRAIN_T": "x"})
    with _launch_environ(cfg, _plan(cfg, "t.py", [], env=LOCAL, environ={})):
        assert os.environ["OMP_NUM_THREADS"] == "1"
        assert os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
        assert os.environ["SCALETRAIN_T"] == "x"
    assert dict(os.environ) == before


def test_launch_environ_keeps_the_users_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    cfg = LaunchConfig(nproc_per_node=2)
    with _launch_environ(cfg, _plan(cfg, "t.py", [], env=LOCAL, environ={})):
        assert os.environ["OMP_NUM_THREADS"] == "4"
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ  # no restarts


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "reply", [b"", b"HTTP/1.0 400 Bad Request\r\n\r\n"], ids=["silent", "http"]
)
def test_endpoint_held_by_another_service_fails_within_the_timeout(
    script: str, reply: bytes
) -> None:
    # A port held by something that is not a rendezvous store accepts the connection;
    # torch's store client would then wait past --rdzv-timeout for an answer.
    import threading

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        stop = threading.Event()

        def serve() -> None:
            server.settimeout(0.2)
            held = []
            while not stop.is_set():
                try:
                    conn, _ = server.accept()
                except OSError:
                    continue
                if reply:
                    conn.sendall(reply)
                held.append(conn)
            for conn in held:
                conn.close()

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        start = time.monotonic()
        try:
            with pytest.raises(LaunchError) as info:
                launch(two_nodes(1, f"127.0.0.1:{port}", rdzv_timeout=5), script)
        finally:
            stop.set()
            thread.join(timeout=5)
    assert time.monotonic() - start < 5 + 5  # the timeout, plus slack for a loaded machine
    msg = str(info.value)
    assert f"127.0.0.1:{port}" in msg and "not a rendezvous store" in msg
    assert "--node-rank 0" in msg and "free port" in msg


@pytest.mark.timeout(30)
@pytest.mark.parametrize("libuv", [True, False])
def test_store_probe_speaks_to_a_real_store(libuv: bool) -> None:
    # The probe speaks c10d's wire protocol by hand: this fails if torch changes it.
    import torch.distributed as dist

    from scaletrain.launch.checks import is_rendezvous_store

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=libuv)
    assert is_rendezvous_store("127.0.0.1", store.port, 5.0) is None
    del store
