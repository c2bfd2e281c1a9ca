"""The PipeDream optimizer: cost model, partitioning DP and planner (``pipedream plan``).

Pure arithmetic over a :class:`~pipedream.formats.Profile`; never imports torch, so planning
takes a fraction of a second. Modules:

* :mod:`~pipedream.optimizer.cost_model` -- PipeDream's cost model (SOSP'19 section 3.1);
* :mod:`~pipedream.optimizer.memory` -- per-worker memory estimate by schedule;
* :mod:`~pipedream.optimizer.partition` -- the dynamic program over stages and replicas;
* :mod:`~pipedream.optimizer.planner` -- Profile + Topology + options -> Plan with prediction;
* :mod:`~pipedream.optimizer.report` -- the summary and comparison tables;
* :mod:`~pipedream.optimizer.command` -- the ``pipedream plan`` verb.
"""

__all__: list[str] = []
