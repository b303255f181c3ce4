"""Real Gloo ranks: DDP equals one process on the whole batch; data, eval and reduce are exact.

Each world size runs ONE spawned job that does every check (spawning ranks
costs seconds on 2 cores); the tests below assert on its results.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from scaletrain.data import ShardedSampler
from scaletrain.errors import ConfigError
from scaletrain.testing import launcher_variables, run_ranks

pytestmark = pytest.mark.timeout(180)

N_TRAIN = 96
N_EVAL = 1001  # odd on purpose: shards are uneven, padding would double-count
N_SAMPLER = 103
PER_RANK_BATCH = 4
STEPS = 6
SEED = 3


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_TRAIN, 10, generator=g)
    y = torch.randint(0, 4, (N_TRAIN,), generator=g)
    return x, y


def _model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 4))


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


class _Indices(torch.utils.data.Dataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _job(order_file: str) -> dict[str, Any]:
    import scaletrain as st
    from scaletrain.train import evaluate

    rt = st.init(strategy="ddp", timeout=123)
    res: dict[str, Any] = {
        "rank": rt.rank,
        "world_size": rt.world_size,
        "backend": rt.backend,
        "device": str(rt.device),
        "env": rt.env.kind,
    }

    # reduce: every op, tensors and numbers, one call each.
    r = rt.rank
    values = {"vec": torch.tensor([r + 1.0, 2.0 * (r + 1)]), "count": r + 1, "half": 0.5 * r}
    res["reduce"] = {op: rt.reduce(values, op=op) for op in ("sum", "mean", "max", "min")}
    # Names or shapes that differ between ranks: refused on every rank (they added
    # unrelated values, or hung the collective); names in another order are the same.
    refused: dict[str, str | None] = {}
    for case, given in {
        "names": {"a" if r == 0 else "b": 1.0},
        "extra": {"a": 1.0, **({"b": 2.0} if r else {})},
        "shape": {"a": torch.ones(2 + r)},
    }.items():
        try:
            refused[case] = repr(rt.reduce(given))
        except ConfigError as exc:
            refused[case] = f"ConfigError: {exc}"
    res["refused"] = refused
    # One rank called wrongly: it raises why, every other rank a PeerFailure (they
    # waited for it until the timeout); a number and a 1-element tensor add up.
    try:
        rt.reduce({"a": "x" if r == 1 else 1.0})  # type: ignore[dict-item]
        res["one_wrong"] = "nothing raised"
    except Exception as exc:
        res["one_wrong"] = f"{type(exc).__name__}: {exc}"
    res["number_and_tensor"] = float(rt.reduce({"a": 1.0 if r else torch.ones(1)})["a"])
    res["mixed"] = rt.reduce({"a": 1 if r == 0 else 1.5, "b": 2})
    res["order"] = rt.reduce({"x": 1.0, "y": 2.0} if r == 0 else {"y": 2.0, "x": 1.0})
    # scaletrain's own group waits as long as st.init(timeout=...) says (torch gives a
    # new group 30 minutes): a peer missing from rt.reduce fails, not hangs.
    from scaletrain.dist.collectives import control_group

    cpu = control_group()._get_backend(torch.device("cpu"))
    res["control_timeout_s"] = cpu.options._timeout.total_seconds()

    # rank_zero_first: rank 0 writes first, the others only after it finished.
    with rt.rank_zero_first(), open(order_file, "a") as f:
        f.write(f"{rt.rank}\n")

    # The sampler over two epochs: training (padded) and evaluation (exact) modes.
    train_idx = rt.loader(_Indices(N_SAMPLER), batch_size=5, shuffle=True, seed=SEED)
    res["train_epochs"] = [[int(i) for b in train_idx for i in b] for _ in range(2)]
    eval_idx = rt.loader(_Indices(N_SAMPLER), batch_size=5, shuffle=False, pad=False)
    res["eval_indices"] = [int(i) for b in eval_idx for i in b]

    # DDP training: per-step global loss and final weights.
    x, y = _data()
    bare = _model()
    model, opt = rt.setup(bare, _optimizer(bare))
    loader = rt.loader(
        torch.utils.data.TensorDataset(x, y), batch_size=PER_RANK_BATCH, shuffle=True, seed=SEED
    )
    losses = []
    batches = iter(loader)
    for _ in range(STEPS):
        xb, yb = next(batches)
        loss = nn.functional.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(rt.reduce({"loss": loss.detach()}, op="mean")["loss"]))
    res["losses"] = losses
    res["weights"] = {k: v.detach().clone() for k, v in rt.unwrap(model).state_dict().items()}
    res["wrapped"] = type(model).__name__

    # Evaluation over an odd-sized set: every sample exactly once over all ranks.
    g = torch.Generator().manual_seed(5)
    ex = torch.randn(N_EVAL, 10, generator=g)
    ey = torch.randint(0, 4, (N_EVAL,), generator=g)
    eval_loader = rt.loader(
        torch.utils.data.TensorDataset(ex, ey), batch_size=64, shuffle=False, pad=False
    )
    result = evaluate(rt, model, eval_loader)
    res["eval"] = (result.loss, result.accuracy, result.count)
    rt.shutdown()
    return res


def _reference(world_size: int) -> dict[str, Any]:
    """One process, the global batch of every step: the concatenation of the ranks' batches."""
    x, y = _data()
    model = _model()
    opt = _optimizer(model)
    shards = [
        list(ShardedSampler(N_TRAIN, num_replicas=world_size, rank=r, shuffle=True, seed=SEED))
        for r in range(world_size)
    ]
    losses = []
    for step in range(STEPS):
        idx = [i for s in shards for i in s[step * PER_RANK_BATCH : (step + 1) * PER_RANK_BATCH]]
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    g = torch.Generator().manual_seed(5)
    ex = torch.randn(N_EVAL, 10, generator=g)
    ey = torch.randint(0, 4, (N_EVAL,), generator=g)
    with torch.no_grad():
        logits = model(ex)
        eval_loss = nn.functional.cross_entropy(logits, ey, reduction="sum").item() / N_EVAL
        acc = int((logits.argmax(1) == ey).sum()) / N_EVAL
    return {"losses": losses, "weights": model.state_dict(), "eval": (eval_loss, acc, N_EVAL)}


_CACHE: dict[int, list[dict[str, Any]]] = {}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    world_size: int = request.param
    if world_size not in _CACHE:
        order = tmp_path_factory.mktemp(f"w{world_size}") / "order.txt"
        _CACHE[world_size] = run_ranks(_job, world_size, str(order), timeout=150)
        _CACHE[world_size][0]["order_file"] = str(order)
    return world_size, _CACHE[world_size]


def test_ranks_see_the_job(job: Any) -> None:
    world_size, results = job
    assert [r["rank"] for r in results] == list(range(world_size))
    for r in results:
        assert (r["world_size"], r["backend"], r["device"], r["env"]) == (
            world_size,
            "gloo",
            "cpu",
            "torchelastic",
        )
        assert r["wrapped"] == "DistributedDataParallel"


def test_reduce_each_op(job: Any) -> None:
    world_size, results = job
    ranks = range(world_size)
    expected = {
        "sum": ([sum(r + 1.0 for r in ranks), sum(2.0 * (r + 1) for r in ranks)], world_size * (world_size + 1) // 2, sum(0.5 * r for r in ranks)),
        "mean": ([(world_size + 1) / 2, world_size + 1.0], (world_size + 1) / 2, 0.25 * (world_size - 1)),
        "max": ([float(world_size), 2.0 * world_size], world_size, 0.5 * (world_size - 1)),
        "min": ([1.0, 2.0], 1, 0.0),
    }  # fmt: skip
    for r in results:
        for op, (vec, count, half) in expected.items():
            got = r["reduce"][op]
            assert got["vec"].dtype == torch.float32
            assert got["vec"].tolist() == pytest.approx(vec, abs=0)
            assert got["count"] == pytest.approx(count, abs=0)
            assert got["half"] == pytest.approx(half, abs=1e-12)
        assert isinstance(r["reduce"]["sum"]["count"], int)


def test_reduce_refuses_names_or_shapes_that_differ_between_ranks(job: Any) -> None:
    world_size, results = job
    for r in results:
        for case, said in r["refused"].items():
            assert said.startswith("ConfigError: rt.reduce: the ranks passed different names "
                                   "or sizes to reduce (this rank: "), (case, said)  # fmt: skip
            assert "Fix: give every rank every name" in said, said
        assert "this rank: 'a' (3 elements))" in r["refused"]["shape"] or r["rank"] != 1
        assert r["one_wrong"].startswith(
            "ConfigError: reduce() got a='x'" if r["rank"] == 1
            else "PeerFailure: rt.reduce: another rank was called wrongly"
        ), r["one_wrong"]  # fmt: skip
        assert r["number_and_tensor"] == world_size
        # An int comes back an int only where the result is whole: every rank agrees.
        assert r["mixed"] == {"a": 1 + 1.5 * (world_size - 1), "b": 2 * world_size}
        assert isinstance(r["mixed"]["b"], int)
        assert r["order"] == {"x": world_size * 1.0, "y": world_size * 2.0}
        assert list(r["order"]) == (["x", "y"] if r["rank"] == 0 else ["y", "x"])
        assert r["control_timeout_s"] == 123


def test_rank_zero_first_runs_rank_zero_before_the_others(job: Any) -> None:
    _, results = job
    lines = Path(results[0]["order_file"]).read_text().split()
    assert lines[0] == "0"
    assert sorted(lines) == sorted(str(r["rank"]) for r in results)


def test_sampler_covers_the_dataset_once_per_epoch(job: Any) -> None:
    world_size, results = job
    for epoch in range(2):
        shards = [r["train_epochs"][epoch] for r in results]
        assert len({len(s) for s in shards}) == 1, "padded shards must be equal"
        union = [i for s in shards for i in s]
        assert set(union) == set(range(N_SAMPLER))
        # Padding repeats only enough samples to make the shards equal.
        assert len(union) - N_SAMPLER == (-N_SAMPLER) % world_size
    assert results[0]["train_epochs"][0] != results[0]["train_epochs"][1], "no reshuffle"
    exact = sorted(i for r in results for i in r["eval_indices"])
    assert exact == list(range(N_SAMPLER))


def test_ddp_matches_one_process_on_the_global_batch(job: Any) -> None:
    world_size, results = job
    ref = _reference(world_size)
    # float32; DDP sums the ranks' gradients in another order than one backward over
    # the concatenated batch, so results agree to rounding, not bitwise.
    for r in results:
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-6, abs=1e-7)
        for name, value in ref["weights"].items():
            torch.testing.assert_close(r["weights"][name], value, rtol=1e-5, atol=1e-6)
    # Every replica holds exactly the same weights.
    for r in results[1:]:
        for name, value in results[0]["weights"].items():
            assert torch.equal(r["weights"][name], value), name


def test_evaluation_counts_every_sample_once(job: Any) -> None:
    _, results = job
    ref = _reference(len(results))
    for r in results:
        loss, acc, count = r["eval"]
        assert count == N_EVAL
        assert loss == pytest.approx(ref["eval"][0], rel=1e-5)
        assert acc == pytest.approx(ref["eval"][1], abs=1e-12)


def test_single_process_runs_the_same_code_without_wrapper(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in launcher_variables():
        monkeypatch.delenv(var)
    import scaletrain as st

    rt = st.init(strategy="ddp")
    try:
        assert (rt.rank, rt.world_size, rt.env.kind, rt.is_main) == (0, 1, "local", True)
        bare = _model()
        model, _ = rt.setup(bare, _optimizer(bare))
        assert model is bare
        assert rt.reduce({"a": 2.0}, op="mean") == {"a": 2.0}
        with rt.rank_zero_first():
            pass
        rt.barrier()
    finally:
        rt.shutdown()
        rt.shutdown()  # idempotent
