"""`tidal` at one offline QPS over a config's whole window (emulated): offline tok/s, req/s, online
violation, as one `tidal sim max-offline` probe. Usage: python docs/results/colocation/policy_simpoint.py
CONFIG QPS CPU_WORKERS [KEY=VALUE ...] (QPS 0: the config's own offline rate)."""
import json, sys, time, dataclasses
from tidal.configs import config_path
from tidal.config.cluster import parse_config, set_path
from tidal.sim.build import simulate, with_offline_rate
from tidal.sim.metrics import summarize
import yaml
cfgname, qps, workers = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
data = yaml.safe_load(config_path(cfgname).read_text())
set_path(data, f"cpu_workers.count={workers}")
for s in sys.argv[4:]:
    set_path(data, s)
cfg = parse_config(data, cfgname)
c = with_offline_rate(cfg, qps) if qps > 0 else cfg
t = time.time()
s = summarize(simulate(c, "tidal"), c.duration_s, "tidal", cfg.name)
out = {"config": cfgname, "qps": qps, "cpu_workers": workers, "sets": sys.argv[4:],
       "offline_tokens_per_s": s["offline"]["tokens_per_s"], "offline_requests_per_s": s["offline"]["requests_per_s"],
       "violation_pct": s["online"]["violation_pct"], "wall_s": round(time.time() - t, 1)}
print(json.dumps(out))
