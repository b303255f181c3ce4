"""Logic with no process group: strategy names, backends, configs, CLI surface, messages."""

from __future__ import annotations

import ast
import functools
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

import scaletrain as st
from scaletrain.cli import build_parser
from scaletrain.dist import choose_backend, choose_device, reduce_values
from scaletrain.strategies import DDP, STRATEGIES, SingleDevice, resolve_strategy
from scaletrain.strategies import base as strategies_base
from scaletrain.train import TrainConfig


def test_strategy_names_and_objects() -> None:
    assert isinstance(resolve_strategy("ddp"), DDP)
    assert isinstance(resolve_strategy("DDP"), DDP)
    assert isinstance(resolve_strategy(None), DDP)
    assert isinstance(resolve_strategy("single"), SingleDevice)
    custom = DDP(bucket_cap_mb=50, static_graph=True)
    assert resolve_strategy(custom) is custom
    assert {"ddp", "single"} <= set(STRATEGIES)


def _calls_a_hook(node: ast.AST) -> bool:
    """`self._name(...)`: a call of one of the strategy's own private methods."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
        and node.func.attr.startswith("_")
    )


def test_no_public_strategy_method_only_forwards_to_a_hook() -> None:
    """A strategy overrides the public method it changes (setup_optimizer, unwrap,
    no_sync, ...); a `_hook` stays only under a public method that does work of its own
    around it (validate's checks, full_state_dict's snapshot, predict's no_grad). Ten
    public methods once did nothing but call their hook."""
    tree = ast.parse(inspect.getsource(strategies_base))
    (strategy,) = (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Strategy")
    forwarders = []
    for method in strategy.body:
        if not isinstance(method, ast.FunctionDef) or method.name.startswith("_"):
            continue
        body = method.body[1:] if ast.get_docstring(method) else method.body
        if len(body) != 1:
            continue
        (only,) = body
        forwards = isinstance(only, (ast.Return, ast.Expr)) and _calls_a_hook(only.value)
        # A context manager that only enters its hook's: `with self._hook(m): yield`.
        enters = (
            isinstance(only, ast.With)
            and all(_calls_a_hook(item.context_expr) for item in only.items)
            and all(isinstance(s, ast.Expr) and isinstance(s.value, ast.Yield) for s in only.body)
        )
        if forwards or enters:
            forwarders.append(method.name)
    assert forwarders == []


def test_unknown_strategy_names_the_choices() -> None:
    with pytest.raises(st.ConfigError, match=r"strategy='warp'.*expected one of.*ddp"):
        resolve_strategy("warp")
    # A near spelling gets its fix, as the CLI's --strategy does.
    with pytest.raises(st.ConfigError, match=r"Fix: strategy='fsdp'"):
        resolve_strategy("fdsp")


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"comm_hook": "int4"}, "comm_hook='int4'"),
        ({"bucket_cap_mb": 0}, "bucket_cap_mb=0"),
        ({"powersgd_rank": 0}, "powersgd_rank=0"),
    ],
)
def test_ddp_config_is_validated(kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(st.ConfigError, match=words):
        DDP(**kwargs)  # type: ignore[arg-type]


def test_bf16_hook_on_cpu_says_it_needs_cuda_and_nccl() -> None:
    with pytest.raises(st.ConfigError) as info:
        st.init(strategy=DDP(comm_hook="bf16"), env="local")
    message = str(info.value)
    assert "CUDA" in message and "NCCL" in message and "gloo" in message
    assert "comm_hook='fp16'" in message  # the fix


def test_backend_choice() -> None:
    assert choose_backend(None, cuda=False) == "gloo"
    assert choose_backend("auto", cuda=False) == "gloo"
    assert choose_backend("GLOO", cuda=False) == "gloo"
    with pytest.raises(st.ConfigError, match=r"backend='nccl' needs CUDA"):
        choose_backend("nccl", cuda=False)
    with pytest.raises(st.ConfigError, match=r"backend='tcp'.*nccl, gloo, mpi"):
        choose_backend("tcp", cuda=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_device_choice_on_cpu() -> None:
    assert choose_device(0, backend="gloo") == torch.device("cpu")
    assert choose_device(1, backend="gloo", device="cpu") == torch.device("cpu")
    with pytest.raises(st.ConfigError, match="names GPU 3"):
        choose_device(0, backend="gloo", device="cuda:3")


def test_reduce_without_process_group_is_identity() -> None:
    out = reduce_values({"t": torch.tensor([1.0, 2.0]), "n": 3, "x": 0.5}, op="max")
    assert out["t"].tolist() == [1.0, 2.0] and out["n"] == 3 and out["x"] == 0.5
    with pytest.raises(st.ConfigError, match="op='avg'.*sum, mean, max, min"):
        reduce_values({"n": 1}, op="avg")
    with pytest.raises(st.ConfigError, match="name='x'.*str"):
        reduce_values({"name": "x"})  # type: ignore[dict-item]


@pytest.mark.parametrize(
    ("field", "value"),
    [("epochs", 0), ("batch_size", -1), ("nproc", 0), ("max_steps", 0), ("lr", -0.1)],
)
def test_train_config_rejects_bad_values(field: str, value: object) -> None:
    with pytest.raises(st.ConfigError, match=f"{field}={value!r}"):
        TrainConfig(**{field: value})  # type: ignore[arg-type]


def _flags(parser: object, command: str) -> list[str]:
    import argparse

    assert isinstance(parser, argparse.ArgumentParser)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(o for a in sub.choices[command]._actions for o in a.option_strings)


def test_cli_flags_are_frozen() -> None:
    """Changing a user-facing flag breaks scripts: update this list on purpose only."""
    parser = build_parser()
    assert _flags(parser, "train") == sorted(
        ["-h", "--help", "--recipe", "--nproc", "--epochs", "--max-steps", "--batch-size",
         "--lr", "--strategy", "--mesh", "--sync-bn", "--no-sync-bn", "--backend", "--data-dir",
         "--out", "--seed", "--log-every", "--precision", "--accumulate", "--clip-grad",
         "--save-every", "--keep", "--async-save", "--stop-after", "--max-restarts",
         "--hang-timeout",
         # issue 7: one config (flags generated from TrainConfig, --config FILE)
         "--config", "--schedule", "--warmup", "--num-workers", "--eval-batch-size",
         "--eval-batches", "--no-async-save",
         # issue 8: fork a run, replace a finished one (issue 26: without the --no- forms,
         # which did nothing: both are off unless given)
         "--fork", "--fork-optimizer", "--overwrite",
         # issue 9: the step ledger and the profile window
         "--ledger", "--no-ledger", "--ledger-every", "--profile",
         # issue 10: many machines (the multi-node flags a torchrun user knows)
         "--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-id", "--local-addr", "--env",
         # issue 12: the elastic agent's polling interval
         "--monitor-interval",
         # issue 26: a finished run keeps its last checkpoint unless told not to
         "--save-last", "--no-save-last",
         # issue 27: your own model and data; the experiment trackers rank 0 writes to
         "--model", "--data", "--track",
         # issue 28: the levers of large-model training
         "--ac", "--ac-every", "--compile", "--no-compile", "--float8", "--no-float8"]
    )  # fmt: skip
    launch = _flags(parser, "launch")
    for flag in ("--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-endpoint",
                 "--max-restarts", "--local-addr", "--env", "--monitor-interval"):  # fmt: skip
        assert flag in launch


def test_library_mistakes_are_refused_in_the_apis_words(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 26 item 20: rt.reduce(3.0) raised AttributeError ('float' object has no
    attribute 'items'), rt.save(path, model) a TypeError about positional arguments, and
    rt.load on a wrong path named save_checkpoint and latest_checkpoint, which the docs
    never teach."""
    from scaletrain.testing import launcher_variables

    for var in launcher_variables():
        monkeypatch.delenv(var)
    with st.init(strategy="single", env="local") as rt:
        model = torch.nn.Linear(2, 2)
        with pytest.raises(st.ConfigError, match=r"rt.reduce\(3.0\).*Fix: .*rt.reduce\(\{'loss'"):
            rt.reduce(3.0)  # type: ignore[arg-type]
        for call in (rt.save, rt.load):
            name = call.__name__
            with pytest.raises(st.ConfigError, match=rf"rt.{name}\(path, Linear\): .*by name.*"
                               rf"Fix: rt.{name}\('runs/x/.*model=model"):  # fmt: skip
                call("runs/x", model)
            with pytest.raises(st.ConfigError, match=rf"rt.{name}\(Linear, ...\): the first"):
                call(model, model=model)  # type: ignore[arg-type]
        # rt.loader named its class (ShardedLoader) and gave no fix.
        with pytest.raises(st.ConfigError, match=r"^batch_size=0: .*Fix: batch_size=32"):
            rt.loader([(torch.zeros(2), 0)] * 4, batch_size=0)
        with pytest.raises(st.CheckpointError) as info:
            rt.load("runs/nowhere/checkpoints/step-000100", model=model)
        message = str(info.value)
        assert "does not exist" in message and "rt.save" in message, message
        assert "CheckpointManager(rt, RUN).resume" in message
        assert "save_checkpoint" not in message and "latest_checkpoint" not in message


def test_setup_clip_and_loader_refuse_what_fails_later_inside_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A second rt.setup of a model wrapped it again (DDP(DDP(...)): its first backward
    raised torch's "please file an issue"); clip_grad_norm took max_norm=-1.0 (the
    gradients' sign flipped) and an optimizer of None (AttributeError); rt.loader took a
    DataLoader, an IterableDataset or a dict and failed at the first batch."""
    from scaletrain.testing import launcher_variables

    for var in launcher_variables():
        monkeypatch.delenv(var)
    with st.init(strategy="single", env="local") as rt:
        model = torch.nn.Linear(4, 1)
        model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(st.ConfigError, match=r"^rt.setup\(model\): this Linear is already "
                           r"set up .*Fix: call rt.setup once per model"):  # fmt: skip
            rt.setup(model, opt)
        with pytest.raises(st.ConfigError, match=r"rt.setup\(model\): got a str; expected"):
            rt.setup("model")  # type: ignore[call-overload]
        with pytest.raises(st.ConfigError, match=r"the optimizer is a list; expected a torch"):
            rt.setup(torch.nn.Linear(2, 2), [])  # type: ignore[call-overload]
        model(torch.ones(2, 4)).sum().backward()
        before = model.weight.grad.clone()
        for kwargs, said in (
            ({"max_norm": -1.0}, r"max_norm=-1.0\): expected a positive number"),
            ({"max_norm": "1.0"}, r"max_norm='1.0'\): expected a positive number"),
            ({"max_norm": 1.0, "norm_type": 0}, r"norm_type=0\): expected a positive number"),
        ):
            with pytest.raises(st.ConfigError, match=said):
                rt.clip_grad_norm(model, opt, **kwargs)  # type: ignore[arg-type]
        with pytest.raises(st.ConfigError, match=r"the optimizer is a NoneType; expected"):
            rt.clip_grad_norm(model, None, max_norm=1.0)  # type: ignore[arg-type]
        assert torch.equal(model.weight.grad, before)  # nothing clipped by a refusal
        data = torch.utils.data.TensorDataset(torch.zeros(8, 2), torch.zeros(8))

        class Stream(torch.utils.data.IterableDataset[int]):
            def __iter__(self):  # type: ignore[no-untyped-def]
                yield 1

        for dataset, said in (
            (torch.utils.data.DataLoader(data, batch_size=4), r"got a DataLoader; .*Fix: pass "
             r"its dataset \(rt.loader\(loader.dataset"),
            (Stream(), r"got a Stream; expected a map-style dataset"),
            ((x for x in range(3)), r"got a generator; expected a map-style dataset"),
            ({"a": 1}, r"got a dict without the key 0; .*Fix: a list of samples"),
        ):  # fmt: skip
            with pytest.raises(st.ConfigError, match=said):
                rt.loader(dataset, batch_size=4)
        assert len(rt.loader(data, batch_size=4)) == 2 and len(rt.loader([1, 2], 1)) == 2
        assert len(rt.loader({0: 1, 1: 2}, 1)) == 2  # a dict of indices, as DataLoader takes


def _needs_two(a: int, b: int) -> int:
    return a + b


def _injected(fn: Any) -> Any:
    """A decorator that supplies the function's first argument, as hydra.main does."""

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        return fn("supplied", *args)

    return run


@_injected
def _needs_a_context(context: str, lr: float) -> float:
    return lr


def test_wrong_types_and_orders_are_refused_with_the_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Each of these raised a bare TypeError, AttributeError or torch's RuntimeError
    (st.init(timeout="30"), DDP(bucket_cap_mb="25"), device="gpu", CheckpointManager's
    arguments swapped, maybe_save("1"), resume(model), st.launch(fn, 2, ...)), wrote a
    checkpoint of nothing but its step (maybe_save(1)), named an internal function
    (rt.save(path)), or started every process before failing (a missing argument)."""
    from scaletrain.testing import launcher_variables

    for var in launcher_variables():
        monkeypatch.delenv(var)
    monkeypatch.chdir(tmp_path)
    cases = [
        (lambda: st.init(timeout="30", env="local"), r"^timeout='30': expected seconds"),
        (lambda: DDP(bucket_cap_mb="25"), r"DDP\(bucket_cap_mb='25'\) must be positive"),
        (lambda: choose_device(0, backend="gloo", device="gpu"),
         r"^device='gpu': expected a torch device name: 'cpu', 'cuda'"),
        (lambda: resolve_strategy(st.DDP),
         r"strategy=DDP is the class; .*Fix: strategy=st.DDP\(\) .*or strategy='ddp'"),
        (lambda: st.FSDP(mixed_precision="bf16"), r"st.init\(precision='bf16-mixed'\)"),
        (lambda: st.launch(_needs_two, 2, (1,)),
         r"st.launch\(fn, 2, \(1,\)\): .*passed by name"),
        (lambda: st.launch(_needs_two, nproc=2, args=(1,)),
         r"_needs_two\(a, b\) cannot be called with them \(missing a required "
         r"argument: 'b'\)"),
    ]  # fmt: skip
    if not torch.cuda.is_available():
        cases.append((lambda: choose_device(0, backend="gloo", device="cuda:0"),
                      r"0 visible GPU\(s\)\. Fix: device='cpu'"))  # fmt: skip
    for call, said in cases:
        with pytest.raises(st.ConfigError, match=said):
            call()
    # A decorated function is called as its decorator takes it (which may supply some).
    from scaletrain.launch.function import _check_call

    _check_call(_needs_a_context, "_needs_a_context", (0.1,))
    with st.init(strategy="single", env="local") as rt:
        model = torch.nn.Linear(2, 2)
        with pytest.raises(st.ConfigError, match=r"^rt.save\(path\): nothing to save"):
            rt.save("runs/x/checkpoints/step-000001")
        with pytest.raises(st.ConfigError, match=r"CheckpointManager\(str, ...\): the first "
                           r"argument is the Runtime .*Fix: CheckpointManager\(rt, 'runs/mine'\)"):  # fmt: skip
            st.CheckpointManager("runs/x", rt)  # type: ignore[arg-type]
        with pytest.raises(st.ConfigError, match=r"CheckpointManager\(rt, int\)"):
            st.CheckpointManager(rt, 3)  # type: ignore[arg-type]
        manager = st.CheckpointManager(rt, "runs/x")
        with pytest.raises(st.ConfigError, match=r"maybe_save\(step='1', ...\): expected"):
            manager.maybe_save("1", model=model)  # type: ignore[arg-type]
        with pytest.raises(st.ConfigError, match=r"maybe_save\(1\): nothing to save"):
            manager.maybe_save(1, force=True)
        with pytest.raises(st.ConfigError, match=r"resume\(Linear\): objects are passed by"):
            manager.resume(model)
        assert not (tmp_path / "runs").exists()


def test_dir_shows_the_public_names_only() -> None:
    """Issue 26 item 20: dir(scaletrain) listed TYPE_CHECKING, annotations and
    lazy_attributes, the package's own imports."""
    import scaletrain
    import scaletrain.observe
    import scaletrain.train

    for package in (scaletrain, scaletrain.observe, scaletrain.train):
        names = dir(package)
        assert not {"TYPE_CHECKING", "annotations", "lazy_attributes", "_lazy"} & set(names)
        assert set(package.__all__) <= set(names)
    assert {"init", "Runtime", "LedgerConfig", "__version__"} <= set(dir(scaletrain))
