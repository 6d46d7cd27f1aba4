"""Discrete-event cluster simulator driving the same `tidal.policy` and `tidal.perf` code as the
live services. Entry points: `tidal.sim.build.simulate` (one run from a config),
`tidal.sim.search` (OOCO max-offline, TaiChi goodput), `tidal.sim.limit` (the most offline
work any schedule could add, the bound max-offline is reported against), `tidal.sim.best_of`
(a baseline at its best setting), `tidal.sim.cli` (`tidal sim ...`). Everything it reports is
simulated."""
