"""The end-of-run evaluation sees the whole model on one device.

The reporting rank's stage shares the model's tensors and moved its own layers to its GPU; the
other stages' layers stayed on the CPU, where the model was built. Evaluating that model as it
stands mixed devices (a GPU run's summary failed so); it is moved to the rank's device first.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pipedream.runtime import summary
from pipedream.workload import Workload


def _workload(seen: list[set[torch.device]]) -> Workload:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))

    def evaluate(trained: nn.Module) -> dict[str, float]:
        seen.append({p.device for p in trained.parameters()})
        return {"layers": float(len(trained))}

    return Workload(
        model=model,
        example_input=torch.zeros(1, 2),
        loss_fn=nn.functional.mse_loss,
        dataset=[],
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        evaluate=evaluate,
    )


@pytest.mark.filterwarnings("ignore:.*meta parameter")
def test_evaluation_moves_every_layer_to_the_reporting_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[set[torch.device]] = []
    workload = _workload(seen)
    state = {k: torch.ones_like(v) for k, v in workload.model.state_dict().items()}
    monkeypatch.setattr(summary, "load_full_state_dict", lambda path: state)
    meta = torch.device("meta")  # stands for the rank's GPU
    workload.model[1].to(meta)  # the rank's own stage, moved there; the other stayed
    metrics = summary.evaluate_checkpoint(workload, Path("unused"), meta)
    assert seen == [{meta}]
    assert metrics == {"layers": 2.0}
