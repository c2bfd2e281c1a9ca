"""The PipeDream optimizer and simulator (``pipedream plan``, ``pipedream simulate``).

Pure arithmetic over a :class:`~pipedream.formats.Profile`; never imports torch, so planning
takes a fraction of a second. Modules:

* :mod:`~pipedream.optimizer.cost_model` -- PipeDream's cost model per level, two variants;
* :mod:`~pipedream.optimizer.memory` -- per-worker memory estimate by schedule and placement;
* :mod:`~pipedream.optimizer.tree` -- hierarchical partitions, their evaluation and ranks;
* :mod:`~pipedream.optimizer.minmax` -- the exact windowed (min, max) product over splits;
* :mod:`~pipedream.optimizer.stage_times` -- stage times of layer ranges, computed on demand;
* :mod:`~pipedream.optimizer.level_dp` -- the dynamic program of one level;
* :mod:`~pipedream.optimizer.hierarchy` -- the hierarchical dynamic program (levels);
* :mod:`~pipedream.optimizer.partition` -- flat partitions and the one-level API;
* :mod:`~pipedream.optimizer.search` -- one schedule's solve, and ``--schedule auto``;
* :mod:`~pipedream.optimizer.planner` -- Profile + Topology + options -> Plan with prediction;
* :mod:`~pipedream.optimizer.baselines` -- the configurations of ``--compare``;
* :mod:`~pipedream.optimizer.report` -- the summary, auto and comparison tables;
* :mod:`~pipedream.optimizer.command` -- the ``pipedream plan`` verb;
* :mod:`~pipedream.optimizer.simulator` -- event simulation of a plan's action tables;
* :mod:`~pipedream.optimizer.timeline` -- the simulated timeline as a text grid and a PNG;
* :mod:`~pipedream.optimizer.simulate_command` -- the ``pipedream simulate`` verb.
"""

__all__: list[str] = []
