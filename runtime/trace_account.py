"""``pipedream trace RUN_DIR --plan PLAN``: where a run's time per minibatch went.

Follows the run's critical path (:mod:`pipedream.optimizer.critical_path`) and prints the
milliseconds per minibatch in each category: compute, the runtime's own work between actions,
posting sends, taking and waiting for messages. For the ``sleep`` workload every action has a
known ideal length (its layers' sleeps), so the part of each forward and backward beyond it is
split off as ``compute overrun`` and the path's ideal length is printed with the efficiency.
"""

from __future__ import annotations

from pipedream.formats.plan import Plan
from pipedream.formats.trace import RankTrace
from pipedream.optimizer.critical_path import Accounting, account
from pipedream.schedules import Op

__all__ = ["account_run", "sleep_ideal_ms"]


def sleep_ideal_ms(plan: Plan, *, source: str) -> dict[tuple[int, Op], float] | None:
    """Each stage's ideal forward, backward and split-backward (I, W) milliseconds under a
    ``sleep`` plan, from its layers' sleeps (None for other workloads).

    A layer whose input needs no gradient (the model's first) spends its whole backward on
    the weight gradient, as :class:`~pipedream.workloads.sleep.SleepLayer` does.
    """
    if plan.workload != "sleep":
        return None
    from pipedream.runtime.stage_layout import stage_layout
    from pipedream.workload import load_workload
    from pipedream.workloads.sleep import SleepLayer

    workload = load_workload(
        plan.workload, plan.workload_args, microbatch_size=plan.microbatch_size, source=source
    )
    layout = stage_layout(workload, plan, source=source)
    first = workload.model[0]  # its input needs no gradient
    ideal: dict[tuple[int, Op], float] = {}
    for stage in range(plan.num_stages):
        forward = backward = weight = 0.0
        for module in layout.build(stage).modules():
            if isinstance(module, SleepLayer):
                forward += module.forward_s
                backward += module.backward_s
                weight += module.backward_s if module is first else module.weight_s
        ideal[(stage, Op.FORWARD)] = forward * 1000
        ideal[(stage, Op.BACKWARD)] = backward * 1000
        ideal[(stage, Op.BACKWARD_INPUT)] = (backward - weight) * 1000
        ideal[(stage, Op.BACKWARD_WEIGHT)] = weight * 1000
    return ideal


def account_run(
    traces: list[RankTrace], plan: Plan, *, source: str, skip: int | None = None
) -> Accounting:
    """The critical-path accounting of a run of ``plan`` (with ideal times for ``sleep``)."""
    return account(traces, plan, skip=skip, ideal_ms=sleep_ideal_ms(plan, source=source))
