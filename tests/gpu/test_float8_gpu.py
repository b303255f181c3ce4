"""Real float8 on one GPU that has it (compute capability 8.9+: L4, L40S, H100, H200, B200):
the llama model under FSDP in bf16-mixed, float8 + compile against bf16 eager.

(The plumbing is tested on the CPU through torchao's emulation: tests/unit/test_float8.py
and tests/dist/test_float8.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240)]

torchao = pytest.importorskip(
    "torchao", reason="float8 is an optional extra: pip install 'scaletrain[float8]'"
)

STEPS = 30

FLOAT8_RTOL = 0.02
"""|float8 + compile - bf16| / bf16 of each step's loss (about 6 falling to 4.5): float8's
e4m3 rounding (3 mantissa bits) on top of bf16's, averaged down by the dot products,
changes the loss by about 0.2% over these steps (measured with torchao's emulation);
inductor's fused kernels add their own rounding. 10x that is the bound."""


def _capable() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(not _capable(), reason="needs a GPU of compute capability 8.9 or newer")
def test_float8_with_compile_trains_like_bf16(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import scaletrain as st
    from scaletrain.train.models import Llama, LlamaShape

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    shape = LlamaShape(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, max_seq_len=256)
    rt = st.init(strategy="fsdp", precision="bf16-mixed", env="local", ledger=False)
    g = torch.Generator().manual_seed(1)
    # 8 batches seen in turn: the losses fall as the model learns them.
    data = torch.randint(0, shape.vocab_size, (64, 129), generator=g).to(rt.device)

    def train(float8: bool) -> tuple[list[float], nn.Module]:
        strategy = rt.strategy
        strategy.float8 = strategy.compile = float8
        torch.manual_seed(0)
        bare = Llama(shape)
        model, opt = rt.setup(bare, torch.optim.AdamW(bare.parameters(), lr=1e-3))
        losses = []
        for i in range(STEPS):
            batch = data[(i % 8) * 8 : (i % 8) * 8 + 8]
            opt.zero_grad()
            loss = rt.forward_backward(
                model,
                batch[:, :-1],
                batch[:, 1:],
                lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1).float(), y.flatten()),
            )
            opt.step()
            losses.append(float(loss))
        return losses, model

    bf16, _ = train(False)
    float8, model = train(True)
    rt.shutdown()
    from torchao.float8.float8_linear import Float8Linear

    assert isinstance(model.layers[0].feed_forward.w1, Float8Linear)
    assert type(model.output) is nn.Linear  # the head stays in bf16
    assert bf16[-1] < bf16[0] - 1.0 and float8[-1] < float8[0] - 1.0  # both learn
    assert float8 != bf16  # float8 changed the math...
    # ... within what its rounding allows.
    torch.testing.assert_close(torch.tensor(float8), torch.tensor(bf16), rtol=FLOAT8_RTOL, atol=0)
