"""rt.gather, rt.gather_for_metrics, rt.broadcast_object, rt.autocast and rt.should_stop
on real Gloo ranks, 2 and 3 of them, over a dataset whose shards are uneven (7 samples:
rt.loader(pad=True) repeats 1 at 2 ranks, 2 at 3), and in one process without a process
group. Each world size runs ONE spawned job that does every check."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from scaletrain.data import ShardedSampler
from scaletrain.testing import run_ranks

pytestmark = pytest.mark.timeout(180)

N = 7
BATCH = 2
SEED = 1


def _error(call: Callable[[], Any]) -> str:
    """`type: message` of what `call` raised (the test fails if it raised nothing)."""
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "nothing raised"


def _job() -> dict[str, Any]:
    import scaletrain as st

    rt = st.init(strategy="ddp", precision="bf16-mixed", ledger=False)
    r, w = rt.rank, rt.world_size
    res: dict[str, Any] = {}

    # gather: rank r has r + 1 rows (rank 0 of the bool one has none); rank order.
    res["ints"] = rt.gather(torch.arange(r + 1) + 10 * r)
    res["bools"] = rt.gather(torch.full((r, 2), r % 2 == 1))
    res["bf16"] = rt.gather(torch.full((2,), r + 0.5, dtype=torch.bfloat16))
    res["scalar"] = rt.gather(torch.tensor(float(r)))
    res["tree"] = rt.gather({"p": torch.tensor([r]), "pair": (torch.ones(1, 2) * r, [])})
    # Mistakes raise on every rank; no rank is left waiting, the next collective works.
    res["shapes_differ"] = _error(lambda: rt.gather(torch.zeros(1, r + 1)))
    res["one_wrong_type"] = _error(lambda: rt.gather(torch.zeros(1) if r else [1.0]))
    res["after_errors"] = rt.gather(torch.tensor([r]))

    # gather_for_metrics over a padded, shuffled loader: each sample once.
    loader = rt.loader(TensorDataset(torch.arange(N)), batch_size=BATCH, seed=SEED)
    per_batch, with_padding, mine = [], [], []
    for (idx,) in loader:
        per_batch.append(rt.gather_for_metrics(idx * 2))  # "predictions" of the batch
        with_padding.append(rt.gather(idx))
        mine.append(idx)
    res["per_batch"] = per_batch
    res["with_padding"] = torch.cat(with_padding)
    # After the loop: every batch's rows at once, of the loader named or the latest.
    res["after_loop"] = rt.gather_for_metrics(torch.cat(mine), loader)
    res["after_loop_tree"] = rt.gather_for_metrics({"idx": torch.cat(mine).unsqueeze(1)})
    res["rows_fit_nothing"] = _error(lambda: rt.gather_for_metrics(torch.zeros(5 + r)))
    res["rows_wrong_on_one"] = _error(
        lambda: rt.gather_for_metrics(torch.zeros(5) if r == 0 else torch.cat(mine))
    )
    res["not_a_loader"] = _error(lambda: rt.gather_for_metrics(torch.zeros(1), [1, 2]))  # type: ignore[arg-type]

    # broadcast_object
    res["bcast"] = rt.broadcast_object({"from": r, "list": [r] * 3}, src=w - 1)
    res["src_out_of_range"] = _error(lambda: rt.broadcast_object(1, src=w))
    res["src_bool"] = _error(lambda: rt.broadcast_object(1, src=True))
    res["unpicklable"] = _error(lambda: rt.broadcast_object(threading.Lock() if r == 0 else None))
    res["bcast_after"] = rt.broadcast_object(f"rank {r}", src=1)

    # autocast: the context rt.forward_backward runs the model in.
    with rt.autocast():
        res["autocast"] = (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
    res["outside"] = (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
    seen: list[torch.dtype] = []

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen.append(out.dtype)
        return F.mse_loss(out.float(), y)

    model = rt.setup(nn.Linear(2, 2))
    rt.forward_backward(model, torch.ones(4, 2), torch.zeros(4, 2), loss_fn)
    res["forward_backward"] = seen[0]

    # should_stop: the last rank alone gets SIGTERM during step 3; every rank stops
    # after step 4 (the agreement is collected one step later).
    res["stopped_at"] = None
    for step in range(1, 30):
        if step == 3 and r == w - 1:
            os.kill(os.getpid(), signal.SIGTERM)
        if rt.should_stop():
            res["stopped_at"] = step
            break
    res["reason"], res["still"] = rt.stop_reason, rt.should_stop()
    rt.shutdown()
    return res


def _expected_batches(world: int) -> list[torch.Tensor]:
    """Per batch: each rank's samples of it in rank order, less the padding."""
    samplers = [
        ShardedSampler(N, num_replicas=world, rank=q, shuffle=True, seed=SEED) for q in range(world)
    ]
    out = []
    for start in range(0, len(samplers[0]), BATCH):
        rows = []
        for s in samplers:
            real = s.indices()[~s.padding()]
            positions = torch.arange(len(s))[~s.padding()]
            rows.append(real[(positions >= start) & (positions < start + BATCH)])
        out.append(torch.cat(rows))
    return out


@pytest.fixture(scope="module", params=[2, 3])
def ranks(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    return request.param, run_ranks(_job, request.param, timeout=150)


def test_gather_is_every_ranks_rows_in_rank_order(
    ranks: tuple[int, list[dict[str, Any]]],
) -> None:
    w, results = ranks
    ints = torch.cat([torch.arange(q + 1) + 10 * q for q in range(w)])
    for res in results:
        assert torch.equal(res["ints"], ints)
        assert torch.equal(
            res["bools"], torch.cat([torch.full((q, 2), q % 2 == 1) for q in range(w)])
        )
        assert res["bf16"].dtype == torch.bfloat16
        assert res["bf16"].tolist() == [q + 0.5 for q in range(w) for _ in range(2)]
        assert res["scalar"].tolist() == [float(q) for q in range(w)]
        assert res["tree"]["p"].tolist() == list(range(w))
        assert res["tree"]["pair"][0].tolist() == [[float(q)] * 2 for q in range(w)]
        assert res["tree"]["pair"][1] == []
        assert res["after_errors"].tolist() == list(range(w))


def test_gather_mistakes_raise_on_every_rank(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    results = ranks[1]
    for q, res in enumerate(results):
        assert res["shapes_differ"].startswith("ConfigError: rt.gather: the ranks' tensors")
        assert "rank 0: [1, 1] float32; rank 1: [1, 2] float32" in res["shapes_differ"]
        if q == 0:
            assert res["one_wrong_type"].startswith(
                "ConfigError: rt.gather(data): data[0] is a float"
            )
        else:
            assert res["one_wrong_type"].startswith("PeerFailure: rt.gather: rank 0 was called")


def test_gather_for_metrics_counts_every_sample_once(
    ranks: tuple[int, list[dict[str, Any]]],
) -> None:
    w, results = ranks
    expected = _expected_batches(w)
    for res in results:
        # rt.gather alone counts the repeated samples twice: what this is for.
        assert len(res["with_padding"]) == w * -(-N // w) > N
        assert [b.tolist() for b in res["per_batch"]] == [(e * 2).tolist() for e in expected]
        assert sorted(torch.cat(res["per_batch"]).div(2).tolist()) == list(range(N))
        assert sorted(res["after_loop"].tolist()) == list(range(N))
        assert sorted(res["after_loop_tree"]["idx"].squeeze(1).tolist()) == list(range(N))


def test_gather_for_metrics_mistakes_raise_on_every_rank(
    ranks: tuple[int, list[dict[str, Any]]],
) -> None:
    results = ranks[1]
    for q, res in enumerate(results):
        assert res["rows_fit_nothing"].startswith(
            f"ConfigError: rt.gather_for_metrics: received {5 + q} rows, but the loader's "
            "last batch had"
        ), res["rows_fit_nothing"]
        assert res["rows_wrong_on_one"].startswith(
            "ConfigError: rt.gather_for_metrics: received 5 rows"
            if q == 0
            else "PeerFailure: rt.gather_for_metrics: rank 0 was called wrongly"
        ), res["rows_wrong_on_one"]
        assert res["not_a_loader"].startswith(
            "ConfigError: rt.gather_for_metrics(data, loader=list): expected the loader"
        )


def test_broadcast_object_from_any_rank(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    w, results = ranks
    for q, res in enumerate(results):
        assert res["bcast"] == {"from": w - 1, "list": [w - 1] * 3}
        assert res["src_out_of_range"] == (
            f"ConfigError: rt.broadcast_object(obj, src={w}): src is the rank that holds the "
            f"object, an int from 0 to {w - 1} (world size {w}). Fix: src=0, the rank that "
            "prints and writes files."
        )
        assert res["src_bool"].startswith("ConfigError: rt.broadcast_object(obj, src=True)")
        assert res["unpicklable"].startswith(
            "ConfigError: rt.broadcast_object: the object on rank 0, a lock, cannot be pickled"
            if q == 0
            else "PeerFailure: rt.broadcast_object: rank 0 could not send its object"
        ), res["unpicklable"]
        assert res["bcast_after"] == "rank 1"


def test_autocast_is_the_runs_precision(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    for res in ranks[1]:
        assert res["autocast"] == torch.bfloat16 == res["forward_backward"]
        assert res["outside"] == torch.float32


def test_should_stop_is_the_same_step_on_every_rank(
    ranks: tuple[int, list[dict[str, Any]]],
) -> None:
    w, results = ranks
    for q, res in enumerate(results):
        assert res["stopped_at"] == 4 and res["still"] is True
        assert res["reason"] == ("signal SIGTERM" if q == w - 1 else "a signal on another rank")


def test_one_process_without_a_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    import scaletrain as st
    from scaletrain.testing import launcher_variables

    for name in launcher_variables():
        monkeypatch.delenv(name)
    rt = st.init(strategy="single", precision="bf16-mixed", ledger=False)
    try:
        assert not dist.is_initialized()
        assert rt.gather(torch.tensor(2.0)).tolist() == [2.0]
        assert torch.equal(rt.gather({"a": torch.ones(2, 3)})["a"], torch.ones(2, 3))
        loader = rt.loader(TensorDataset(torch.arange(N)), batch_size=BATCH, seed=SEED)
        got = [rt.gather_for_metrics(idx) for (idx,) in loader]
        assert sorted(torch.cat(got).tolist()) == list(range(N))
        with pytest.raises(st.ConfigError, match=r"received 3 rows, but the loader's last batch"):
            rt.gather_for_metrics(torch.zeros(3))
        # The loader named is the one, also one without batches (len 0, falsy).
        empty = rt.loader(TensorDataset(torch.arange(0)), batch_size=BATCH)
        assert rt.gather_for_metrics(torch.zeros(0), empty).shape == (0,)
        with pytest.raises(st.ConfigError, match=r"data\['x'\] is a str"):
            rt.gather({"x": "text"})
        assert rt.broadcast_object({"k": 1}) == {"k": 1}
        with pytest.raises(
            st.ConfigError, match=r"src=1\): .* an int from 0 to 0 \(world size 1\)"
        ):
            rt.broadcast_object(1, src=1)
        with rt.autocast():
            assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    finally:
        rt.shutdown()


def _tensor_job() -> dict[str, Any]:
    import scaletrain as st

    rt = st.init(strategy="tensor", ledger=False)
    loader = rt.loader(TensorDataset(torch.arange(N)), batch_size=BATCH, shuffle=False)
    rows = torch.cat([rt.gather_for_metrics(idx) for (idx,) in loader])
    count = rt.reduce({"count": sum(len(idx) for (idx,) in loader)})["count"]
    return {"rows": rows.tolist(), "count": count, "dp": (rt.dp_rank, rt.dp_size)}


def test_gather_for_metrics_counts_a_tensor_parallel_replicas_samples_once() -> None:
    """Both tensor-parallel ranks of the one replica read the same batches: gathered from
    every rank, each sample came back twice (and a metric over them counted it twice)."""
    for res in run_ranks(_tensor_job, 2, timeout=150):
        assert res["dp"] == (0, 1)
        assert res["rows"] == list(range(N)), res["rows"]
        # rt.reduce sums over every rank, as its docstring says: N per rank.
        assert res["count"] == 2 * N
