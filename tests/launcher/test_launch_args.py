"""build_torchrun_args and the CLI flags, with no process started."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest

import scaletrain.env
from scaletrain.env.base import ClusterEnv, Rendezvous
from scaletrain.errors import ConfigError
from scaletrain.launch import LaunchConfig, add_arguments, build_torchrun_args, run
from scaletrain.launch import plan as plan_mod
from scaletrain.launch.cli import config_from_args
from scaletrain.launch.failures import summarize_failure

LOCAL = ClusterEnv(
    kind="local",
    rank=0,
    local_rank=0,
    world_size=1,
    local_world_size=1,
    node_rank=0,
    num_nodes=1,
    master_addr="127.0.0.1",
    master_port=29500,
)
SAGEMAKER = dataclasses.replace(
    LOCAL,
    kind="sagemaker",
    node_rank=1,
    num_nodes=3,
    world_size=3,
    rank=1,
    master_addr="algo-1",
    master_port=7777,
    per_node=True,
    procs_per_node_hint=4,
)


def args(cfg: LaunchConfig, *script: str, env: ClusterEnv | None = LOCAL) -> list[str]:
    return build_torchrun_args(cfg, script[0], list(script[1:]), env=env, environ={})


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_single_node_is_standalone() -> None:
    argv = args(LaunchConfig(nproc_per_node=2), "train.py", "--lr", "3")
    assert argv[0] == "--standalone"
    assert flag(argv, "--nnodes") == "1" and flag(argv, "--nproc-per-node") == "2"
    assert flag(argv, "--max-restarts") == "0"
    assert "--rdzv-endpoint" not in argv and "--module" not in argv
    # The script and its own flags come last, untouched.
    assert argv[-3:] == ["train.py", "--lr", "3"]


def test_multi_node_uses_c10d_rendezvous() -> None:
    cfg = LaunchConfig(
        nproc_per_node=8, nnodes="2", node_rank=1, rdzv_endpoint="node0:29400", rdzv_id="job7"
    )
    argv = args(cfg, "train.py")
    assert "--standalone" not in argv
    assert flag(argv, "--rdzv-backend") == "c10d"
    assert flag(argv, "--rdzv-endpoint") == "node0:29400"
    assert flag(argv, "--rdzv-id") == "job7"
    assert flag(argv, "--nnodes") == "2"
    # Node rank 1 never hosts the store, even on node 0's host.
    assert flag(argv, "--rdzv-conf") == "join_timeout=600,is_host=false"
    # torchrun ignores --node-rank for c10d (and warns); it is not passed.
    assert "--node-rank" not in argv


def test_node_zero_hosts_the_store() -> None:
    cfg = LaunchConfig(nnodes="2", node_rank=0, rdzv_endpoint="10.0.0.1:29400", rdzv_timeout=30)
    argv = args(cfg, "train.py")
    assert flag(argv, "--rdzv-conf") == "join_timeout=30,is_host=true"


def test_elastic_range_without_rank_lets_torch_decide() -> None:
    cfg = LaunchConfig(nproc_per_node=1, nnodes="1:4", rdzv_endpoint="head:29400", max_restarts=3)
    argv = args(cfg, "train.py")
    assert flag(argv, "--nnodes") == "1:4"
    assert flag(argv, "--rdzv-backend") == "c10d"
    assert flag(argv, "--rdzv-conf") == "join_timeout=600"
    assert flag(argv, "--max-restarts") == "3"


def test_single_node_with_endpoint_hosts_it() -> None:
    argv = args(LaunchConfig(nproc_per_node=1, rdzv_endpoint="127.0.0.1:29400"), "t.py")
    assert flag(argv, "--rdzv-backend") == "c10d" and "is_host=true" in flag(argv, "--rdzv-conf")


def test_multi_node_without_endpoint_is_explained() -> None:
    with pytest.raises(ConfigError) as info:
        args(LaunchConfig(nnodes="2", node_rank=0), "train.py")
    msg = str(info.value)
    assert "--nnodes 2" in msg and "--rdzv-endpoint" in msg and "--node-rank 0" in msg


def test_module_mode() -> None:
    argv = args(LaunchConfig(nproc_per_node=1, run_as_module=True), "pkg.train", "-x")
    assert argv[-3:] == ["--module", "pkg.train", "-x"]


def test_logs_and_redirects() -> None:
    argv = args(LaunchConfig(nproc_per_node=1, log_dir="logs", redirects="3"), "t.py")
    assert flag(argv, "--log-dir") == "logs" and flag(argv, "--redirects") == "3"


def test_rdzv_id_default_comes_from_the_environment() -> None:
    cfg = LaunchConfig(nproc_per_node=1, nnodes="2", node_rank=0, rdzv_endpoint="h:1")
    assert flag(args(cfg, "t.py"), "--rdzv-id") == "scaletrain"
    for environ in ({"SLURM_JOB_ID": "123"}, {"SCALETRAIN_RDZV_ID": "abc", "SLURM_JOB_ID": "1"}):
        argv = build_torchrun_args(cfg, "t.py", env=LOCAL, environ=environ)
        assert flag(argv, "--rdzv-id") == environ.get("SCALETRAIN_RDZV_ID", "123")


def test_default_nproc_is_two_on_cpu() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("has a GPU: the default is the device count")
    assert flag(args(LaunchConfig(), "t.py"), "--nproc-per-node") == "2"


def test_per_node_env_fills_static_rendezvous() -> None:
    argv = args(LaunchConfig(), "train.py", env=SAGEMAKER)
    assert flag(argv, "--rdzv-backend") == "static"
    assert flag(argv, "--nnodes") == "3"
    assert flag(argv, "--node-rank") == "1"
    assert flag(argv, "--master-addr") == "algo-1"
    assert flag(argv, "--master-port") == "7777"
    assert flag(argv, "--nproc-per-node") == "4"  # the scheduler's hint
    assert flag(argv, "--rdzv-conf") == "timeout=600"
    assert "--standalone" not in argv


def test_user_flags_win_over_per_node_env() -> None:
    argv = args(LaunchConfig(nproc_per_node=2), "t.py", env=SAGEMAKER)
    assert flag(argv, "--nproc-per-node") == "2"
    cfg = LaunchConfig(nnodes="2", node_rank=0, rdzv_endpoint="10.0.0.5:29400")
    argv = args(cfg, "t.py", env=SAGEMAKER)
    assert flag(argv, "--rdzv-backend") == "c10d" and "--master-addr" not in argv
    assert flag(argv, "--nproc-per-node") == "4"  # not given: the hint still applies


def test_per_node_env_on_one_node_is_standalone() -> None:
    one = dataclasses.replace(SAGEMAKER, num_nodes=1, node_rank=0, world_size=1, rank=0)
    assert args(LaunchConfig(), "t.py", env=one)[0] == "--standalone"


def test_env_is_detected_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    # scaletrain.env.detect is developed separately: stub it, present or not.
    seen: list[object] = []

    def fake_detect(environ: object = None) -> ClusterEnv:
        seen.append(environ)
        return SAGEMAKER

    monkeypatch.setattr(scaletrain.env, "detect", fake_detect, raising=False)
    argv = build_torchrun_args(LaunchConfig(), "t.py", environ={"X": "1"})
    assert seen == [{"X": "1"}] and flag(argv, "--rdzv-backend") == "static"
    # With the whole topology and process count given, the environment is not consulted.
    seen.clear()
    cfg = LaunchConfig(nproc_per_node=1, nnodes="2", node_rank=0, rdzv_endpoint="h:1")
    build_torchrun_args(cfg, "t.py", environ={})
    assert seen == []


def test_without_detect_it_acts_as_plain_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(scaletrain.env, "detect", raising=False)
    assert plan_mod._detect_cluster({}, None) is None


def test_torchrun_accepts_the_arguments() -> None:
    run_mod = pytest.importorskip("torch.distributed.run")
    cfg = LaunchConfig(
        nproc_per_node=2, nnodes="1:2", node_rank=0, rdzv_endpoint="h:5", max_restarts=1
    )
    ns = run_mod.parse_args(args(cfg, "train.py", "--epochs", "2", "--nnodes", "9"))
    assert ns.nnodes == "1:2" and ns.nproc_per_node == "2" and ns.rdzv_endpoint == "h:5"
    assert ns.training_script == "train.py"
    assert ns.training_script_args == ["--epochs", "2", "--nnodes", "9"]
    ns = run_mod.parse_args(args(LaunchConfig(), "t.py", env=SAGEMAKER))
    assert (ns.node_rank, ns.master_addr, ns.master_port) == (1, "algo-1", 7777)


# --- the CLI -------------------------------------------------------------------------------


def lead_style_parser() -> argparse.ArgumentParser:
    """The wiring the top-level `scaletrain` CLI uses: a `launch` subparser."""
    parser = argparse.ArgumentParser(prog="scaletrain")
    sub = parser.add_subparsers(dest="command", required=True)
    add_arguments(sub.add_parser("launch"))
    return parser


def test_cli_flags_before_script_are_ours_after_are_the_scripts() -> None:
    ns = lead_style_parser().parse_args(
        ["launch", "--nproc-per-node", "2", "--nnodes", "1:4", "--node-rank", "0",
         "--rdzv-endpoint", "h:29400", "--rdzv-id", "j", "--max-restarts", "2",
         "--rdzv-timeout", "5", "--env", "A=1", "--env", "B=x=y",
         "train.py", "--nproc-per-node", "7", "-m", "--lr=3"]
    )  # fmt: skip
    assert ns.script == "train.py"
    assert ns.script_args == ["--nproc-per-node", "7", "-m", "--lr=3"]
    cfg = config_from_args(ns)
    assert cfg == LaunchConfig(
        nproc_per_node=2, nnodes="1:4", node_rank=0, rdzv_endpoint="h:29400", rdzv_id="j",
        max_restarts=2, rdzv_timeout=5, extra_env={"A": "1", "B": "x=y"},
    )  # fmt: skip


def test_cli_module_flag_and_aliases() -> None:
    ns = lead_style_parser().parse_args(["launch", "--nproc_per_node", "1", "-m", "pkg.train"])
    assert ns.run_as_module and ns.script == "pkg.train" and ns.script_args == []
    assert config_from_args(ns).nproc_per_node == 1


def test_cli_dry_run_prints_torchrun_command(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    ns = lead_style_parser().parse_args(
        ["launch", "--dry-run", "--nproc-per-node", "2", "--nnodes", "1", "my script.py", "a b"]
    )
    assert run(ns) == 0
    out = capsys.readouterr().out.strip()
    # The variables the launcher sets are part of the equivalent command.
    assert out.startswith("OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo torchrun --standalone ")
    assert out.endswith("'my script.py' 'a b'")


def test_cli_dry_run_keeps_the_users_variables(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    ns = lead_style_parser().parse_args(
        ["launch", "--dry-run", "--max-restarts", "1", "--env", "NCCL_DEBUG=INFO", "t.py"]
    )
    assert run(ns) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 NCCL_DEBUG=INFO torchrun ")


def test_cli_bad_flag_value_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    ns = lead_style_parser().parse_args(["launch", "--nnodes", "4:1", "train.py"])
    assert run(ns) == 2
    err = capsys.readouterr().err
    assert err.startswith("scaletrain launch: error: --nnodes '4:1'") and "Fix:" in err


def test_cli_missing_script_exits_2(
    capsys: pytest.CaptureFixture[str], tmp_path: pytest.TempPathFactory
) -> None:
    # Bad input is exit code 2, as the docs' table of exit codes says (it was 1).
    ns = lead_style_parser().parse_args(["launch", "--nproc-per-node", "1", "no_such.py"])
    assert run(ns) == 2
    assert "no_such.py" in capsys.readouterr().err


def test_signal_death_is_summarized_as_a_shell_would() -> None:
    errors = pytest.importorskip("torch.distributed.elastic.multiprocessing.errors")
    failure = errors.ProcessFailure(local_rank=0, pid=42, exitcode=-9, error_file="/no/such/file")
    other = errors.ProcessFailure(local_rank=1, pid=43, exitcode=1, error_file="/no/such/file")
    exc = errors.ChildFailedError("train.py", {2: failure, 3: other})
    summary, code = summarize_failure(exc, redirects="3")
    assert code == 128 + 9
    assert summary.startswith("scaletrain launch: worker rank 2 (local rank 0, pid 42) was killed")
    assert "SIGKILL" in summary and "Other failed ranks: 3." in summary
    assert "log directory" in summary


def test_cli_without_a_script_asks_for_the_script_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as info:
        lead_style_parser().parse_args(["launch", "--nproc-per-node", "2"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    # The script's own arguments are optional: only SCRIPT is named as missing.
    assert err.strip().endswith("the following arguments are required: SCRIPT")


# --- what runs is what --dry-run shows ---------------------------------------------------


def _as_torchrun_runs(argv: list[str]) -> object:
    """torch's own LaunchConfig for a torchrun command line (what `torchrun ARGV` runs)."""
    run_mod = pytest.importorskip("torch.distributed.run")
    config, _, _ = run_mod.config_from_args(run_mod.parse_args(argv))
    return config


KUBEFLOW_ELASTIC = dataclasses.replace(
    SAGEMAKER,
    kind="kubeflow",
    rendezvous=Rendezvous(
        nnodes="1:3", endpoint="job-worker-0:29400", run_id="job", conf="read_timeout=30",
        max_restarts=2,
    ),
)  # fmt: skip


@pytest.mark.parametrize(
    ("cfg", "env"),
    [
        (LaunchConfig(nproc_per_node=2, log_dir="LOGS", redirects="3"), LOCAL),
        (LaunchConfig(nproc_per_node=1, nnodes="2", node_rank=1, rdzv_endpoint="h:29400",
                      rdzv_id="job7", max_restarts=2, monitor_interval=0.5), LOCAL),
        (LaunchConfig(nproc_per_node=1, nnodes="1:4", rdzv_endpoint="[fd00::1]:29400"), LOCAL),
        (LaunchConfig(log_dir="LOGS", rdzv_timeout=30), SAGEMAKER),
        (LaunchConfig(), KUBEFLOW_ELASTIC),
        (LaunchConfig(), dataclasses.replace(KUBEFLOW_ELASTIC, rendezvous=Rendezvous(
            nnodes="2", backend="etcd-v2", endpoint="etcd:2379", run_id="job"))),
    ],
)  # fmt: skip
def test_the_agent_gets_what_the_dry_run_command_says(
    cfg: LaunchConfig, env: ClusterEnv, tmp_path: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    # The launcher builds torch's LaunchConfig itself; torchrun, given the command that
    # --dry-run prints, builds the same, but for scaletrain's rendezvous backends in
    # place of torch's (and, on one node, 127.0.0.1 in place of every interface).
    from scaletrain.launch.launcher import agent_config
    from scaletrain.launch.plan import make_plan
    from scaletrain.launch.rendezvous import LOOPBACK

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torchrun would set it in this process
    if cfg.log_dir is not None:
        cfg = dataclasses.replace(cfg, log_dir=str(tmp_path))
    plan = make_plan(cfg, "train.py", ["--lr", "3"], env=env, environ={})
    ours: Any = agent_config(plan, cfg)
    theirs: Any = _as_torchrun_runs(plan.argv)
    for name in ("min_nodes", "max_nodes", "nproc_per_node", "role", "max_restarts",
                 "monitor_interval", "start_method"):  # fmt: skip
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.signals_to_handle == "SIGTERM,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"
    if cfg.log_dir is not None:
        assert ours.logs_specs.root_log_dir == theirs.logs_specs.root_log_dir == str(tmp_path)
    extra = {"is_host", "scaletrain_node_rank"}
    if plan.mode == "standalone":
        # torchrun's --standalone: c10d at localhost:0 under a fresh id.
        assert (ours.rdzv_backend, ours.rdzv_endpoint) == ("scaletrain-c10d", f"{LOOPBACK}:0")
        assert ours.local_addr == LOOPBACK and ours.rdzv_configs["is_host"] == "true"
    else:
        wrapped = theirs.rdzv_backend in ("c10d", "static")  # another is torch's, as it is
        assert ours.rdzv_backend == ("scaletrain-" if wrapped else "") + theirs.rdzv_backend
        assert ours.run_id == theirs.run_id and ours.local_addr == theirs.local_addr
        if plan.mode == "static":
            # torchrun fills the endpoint in from --master-addr/--master-port at run time.
            assert ours.rdzv_endpoint == f"{plan.host}:{plan.port}"
        else:
            assert ours.rdzv_endpoint == theirs.rdzv_endpoint
        theirs_conf = {k: v for k, v in theirs.rdzv_configs.items() if k not in extra}
        ours_conf = {k: v for k, v in ours.rdzv_configs.items() if k not in extra}
        assert {k: str(v) for k, v in ours_conf.items()} == {
            k: str(v) for k, v in theirs_conf.items()
        }
        assert ours.rdzv_configs.get("is_host") == theirs.rdzv_configs.get("is_host")


def test_every_setting_is_one_flag_declared_once() -> None:
    # The flags are made from LaunchConfig's fields: its docstrings are their help, and a
    # new field is a new flag (torchrun's --a_b spelling too), with no list to keep.
    from scaletrain.settings import field_docs

    parser = lead_style_parser()
    launch = parser._subparsers._group_actions[0].choices["launch"]  # type: ignore[union-attr]
    by_dest = {a.dest: a for a in launch._actions}
    assert by_dest["extra_env"].option_strings == ["--env"]  # NAME=VALUE, or the cluster
    for f in dataclasses.fields(LaunchConfig):
        if f.name in ("extra_env", "cluster"):
            continue
        action = by_dest[f.name]
        assert field_docs(LaunchConfig)[f.name] in (action.help or "").replace("%%", "%")
        if "_" in f.name and f.name != "run_as_module":
            assert f"--{f.name}" in action.option_strings
    assert by_dest["run_as_module"].option_strings == ["-m", "--module"]
    ns = parser.parse_args(["launch", "--monitor_interval", "2", "--redirects", "3", "t.py"])
    assert config_from_args(ns) == LaunchConfig(monitor_interval=2.0, redirects="3")
