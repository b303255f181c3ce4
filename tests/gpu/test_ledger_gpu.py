"""The ledger's CUDA path on a real GPU: events read one step late, no synchronisation in the
hot path (CUDA's sync debug mode raises on one), MFU against the datasheet, CUDA memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def test_cuda_ledger_never_synchronises_and_its_phases_add_up(tmp_path: Path) -> None:
    import scaletrain as st
    from scaletrain.observe.metrics.records import read_run

    rt = st.init(strategy="single", env="local", ledger=st.LedgerConfig(out=tmp_path, every=5))
    assert rt.ledger is not None and rt.ledger._timeline.kind == "cuda"
    torch.manual_seed(0)
    bare = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))
    model, opt = rt.setup(bare, torch.optim.AdamW(bare.parameters(), lr=1e-3))
    data = torch.utils.data.TensorDataset(torch.randn(64 * 30, 1024), torch.randn(64 * 30, 1024))
    loader = rt.loader(data, batch_size=64, pin_memory=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, y in loader:
            x, y = x.to(rt.device, non_blocking=True), y.to(rt.device, non_blocking=True)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    rt.shutdown()
    run = read_run(tmp_path)
    steps = run.ranks[0].steps
    assert [s.step for s in steps] == list(range(1, 31))
    for s in steps[1:]:
        # Each phase and the wall are written to the microsecond: ~9 roundings of up to
        # 0.5 us apart (an H200's 1.8 ms step summed 2 us over, beyond rel=1e-3 alone).
        assert sum(s.phases.values()) == pytest.approx(s.wall, rel=1e-3, abs=1e-5)
        assert s.phases["forward"] > 0 and s.phases["backward"] > 0
    assert run.summary is not None
    mem = run.summary["ranks"][0]
    assert mem["allocated_peak"] > 0 and mem["reserved_peak"] >= mem["allocated_peak"]
    mfu = run.summary["mfu"]
    assert mfu["measured"] is not None and mfu["error"] is None
    name = torch.cuda.get_device_name()
    from scaletrain.hardware import datasheet_peak

    if datasheet_peak(name, run.summary["peak"]["dtype"]) is not None:
        assert mfu["datasheet"] is not None and 0 < mfu["datasheet"] < 1
