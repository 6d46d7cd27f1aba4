"""Workloads: traces, length tables, arrival processes, OOCO trace scaling, online+offline mixes."""

from tidal.workload.arrivals import gamma_arrivals, poisson_arrivals, scale_trace, uniform_arrivals
from tidal.workload.mix import SimRequest, StreamConfig, build_stream, build_workload
from tidal.workload.traces import Trace, data_dir, load_trace

__all__ = [
    "SimRequest",
    "StreamConfig",
    "Trace",
    "build_stream",
    "build_workload",
    "data_dir",
    "gamma_arrivals",
    "load_trace",
    "poisson_arrivals",
    "scale_trace",
    "uniform_arrivals",
]
