"""The report of `tidal bench colocation --search-offline` (`search_cli` runs it): the table,
the limit's lines, the JSON and the plot (attainment and offline tokens/s against the offline
load, one line per policy)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tidal.sim.limit import BINDINGS


def label(report: dict[str, Any]) -> str:
    if report["engine"] == "sim":
        return f"sim engine, EMULATED {report['sim_step_model']} step times"
    return "torch engine, real SmolLM2-135M on this CPU"


def table(report: dict[str, Any]) -> str:
    """The printed table: one line per policy, live beside the simulator, resources below."""
    lines = [
        f"Live max offline load at >= {100 - report['violation']:g}% online SLO attainment "
        f"({label(report)}; {report['config']}, online trace window {report['window']}; "
        f"{report['repeats']} windows a point: attainment over all their online requests, "
        f"offline tok/s their median, [min, max] over the windows; simulator: emulated, with the "
        f"same {report.get('batch_max_inflight', '?')} batch lines in flight):",
        "  policy                   live offline tok/s [spread]       QPS  attain % [spread]"
        "        sim tok/s",
    ]
    for name, e in report["policies"].items():
        lo, hi = e["spread"]["offline_tokens_per_s"]
        alo, ahi = e["spread"]["attainment_pct"]
        sat = " (saturated)" if e["saturated"] else ""
        sim = f"{e['sim_max_offline_tokens_per_s']:9.1f}"
        if "simulator_with_cpu_attn" in e:
            w = e["simulator_with_cpu_attn"]
            sim += f" ({w['max_offline_tokens_per_s']:.1f} with {w['cpu_attn_workers']} CPU-attn)"
        lines.append(
            f"  {name:22s} {e['max_offline_tokens_per_s']:9.1f} [{lo:7.1f}, {hi:7.1f}]"
            f"{sat:12s} {e['max_offline_qps']:6.3g}  {e['attainment']:6.1f} [{alo:5.1f}, "
            f"{ahi:5.1f}] {sim}"
        )
    lines += limit_lines(report)
    lines.append("  resources (per policy):")
    for name, e in report["policies"].items():
        r = e["resources"]
        inst = ", ".join(
            f"{i['count']}x {i['role']}/chunk {i['chunk_size']}" for i in r["instances"]
        )
        lines.append(
            f"    {name}: {inst}; KV {r['kv_cache_tokens_per_instance']} tokens/instance; "
            f"{r['cpu_attn_workers']} CPU-attn worker(s) ({r['cpu_attn_workers_usable']} usable "
            f"by the engine); batch lines in flight <= {r['batch_max_inflight']}; "
            f"{r['host_cores']} host cores, {pinning(r)}"
        )
    if h := report.get("host"):
        lines.append(
            f"  host: {h['cpu_model']}, {h['cores']} cores, shared; load average (1/5/15 min) "
            f"{h['loadavg_start']} at the start, {h.get('loadavg_end', '?')} at the end"
        )
    return "\n".join(lines)


def binding_text(lim: dict[str, Any]) -> str:
    """Which of the limit's two step floors binds (`tidal.sim.limit`, points 2 and 7)."""
    return (
        f"the limit bound by {BINDINGS[lim['binding']]} ({lim['paced_steps']} paced steps, "
        f"{lim['paced_gpu_s']:.1f} GPU-s of step overhead)"
    )


def limit_lines(report: dict[str, Any]) -> list[str]:
    """Per policy: what ended each side's search, live / simulator, and both as shares of the
    computed offline limit (simulated), with what the limit is derived from; then the CPU the
    stack and the load generator used at the live maximum."""
    out = ["  against the computed offline limit (simulated, same config, window, resources):"]
    basis = ""
    for name, e in report["policies"].items():
        live, sim = e["max_offline_tokens_per_s"], e["sim_max_offline_tokens_per_s"]
        ratio = f"{live / sim:.2f}" if sim > 0 else "n/a"
        lim = e.get("limit") or {}
        sim_bound = e.get("simulator", {}).get("bound_text", "?")
        if "tokens_per_s" in lim:
            basis = lim["basis"]
            on = lim.get("devices", "one device an instance")
            on = "" if on == "one device an instance" else f" on {on}"
            share = (
                f"limit {lim['tokens_per_s']:.0f} tok/s{on}: live "
                f"{100 * e['share_of_limit']:.1f}%, simulator {100 * e['sim_share_of_limit']:.1f}%"
            )
            if own := e.get("sim_limit"):  # reports from before the simulator shared devices
                share = (
                    f"limit {lim['tokens_per_s']:.0f} tok/s on {lim['devices']}: live "
                    f"{100 * e['share_of_limit']:.1f}%; simulator "
                    f"{100 * e['sim_share_of_limit']:.1f}% of its own "
                    f"{own['tokens_per_s']:.0f} tok/s ({own['devices']})"
                )
            if "binding" in lim:
                share += f"; {binding_text(lim)}"
        else:
            share = f"no limit: {lim.get('error', 'not computed')}"
        out.append(
            f"    {name}: live {e.get('bound_text', '?')} lines/s, simulator {sim_bound}; "
            f"live / simulator {ratio}; {share}"
        )
    if basis:
        out.append(f"    the limit is {basis}")
    for name, e in report["policies"].items():
        pts = e.get("simulator", {}).get("at_live_probes") or []
        if pts:
            each = ", ".join(
                f"{p['offline_qps']:g}: {p['live_offline_tokens_per_s']:.0f} / "
                f"{p['sim_offline_tokens_per_s']:.0f}"
                + (f" ({p['live_over_sim']:.2f})" if p["live_over_sim"] is not None else "")
                for p in pts
            )
            out.append(f"    {name}, live / simulator tok/s at each live load (QPS): {each}")
    for name, e in report["policies"].items():
        cpu = e.get("cpu")
        if not cpu:
            continue
        top = sorted(cpu["cpu_s_per_s"].items(), key=lambda kv: -kv[1])[:6]
        procs = ", ".join(f"{n} {v:.2f}" for n, v in top)
        cores = ", ".join(f"core {c} {100 * b:.0f}%" for c, b in cpu["core_busy"].items())
        out.append(
            f"    {name} at its maximum, CPU s/s (median window): stack + load generator "
            f"{cpu['stack_and_loadgen_cpu_s_per_s']:.2f} ({procs}); busy: {cores}; "
            f"load average {cpu.get('loadavg_1m', float('nan')):.1f}"
        )
    return out


def pinning(r: dict[str, Any]) -> str:
    """Where the stack's processes ran (`--*-cores`), or that every process shared every core."""
    pins = [(k, r.get(f"{k}_cores")) for k in ("engine", "cpu_attn", "service")]
    if all(v is None for _, v in pins):
        return "shared by every process"
    return "pinned: " + ", ".join(f"{k} {v if v is not None else 'any'}" for k, v in pins)


def plot(report: dict[str, Any], path: str) -> str:
    """Median attainment (min-max bars) and offline tok/s against offered offline QPS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, e in report["policies"].items():
        pts = sorted(e["probes"], key=lambda p: p["offline_qps"])
        x = [p["offline_qps"] for p in pts]
        y = [p["attainment_pct"] for p in pts]
        err = [
            [p["attainment_pct"] - p["attainment_spread"][0] for p in pts],
            [p["attainment_spread"][1] - p["attainment_pct"] for p in pts],
        ]
        line = ax1.errorbar(x, y, yerr=err, marker="o", capsize=3, label=f"{name} (live)")
        colour = line[0].get_color()
        tok = [p["offline_tokens_per_s"] for p in pts]
        ax2.plot(x, tok, marker="o", color=colour, label=f"{name} (live)")
        sim = sorted(e["simulator"].get("probes", []), key=lambda p: p["offline_qps"])
        if sim:  # the simulator's search, same windows: dashed, same colour
            sx = [p["offline_qps"] for p in sim]
            ax1.plot(sx, [p["attainment_pct"] for p in sim], ls="--", marker="x", color=colour)
            ax2.plot(
                sx,
                [p["offline_tokens_per_s"] for p in sim],
                ls="--",
                marker="x",
                color=colour,
                label=f"{name} (simulator)",
            )
    ax1.axhline(100 - report["violation"], color="grey", ls="--", lw=1)
    ax1.set_xlabel("offline load offered through the Batch API (lines/s, uniform)")
    ax1.set_ylabel("online SLO attainment (%): all repeats' requests")
    ax2.set_xlabel("offline load offered (lines/s)")
    ax2.set_ylabel("offline output tokens/s generated in the window")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)
    fig.suptitle(f"Live max-offline search ({label(report)})", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _batch_cap(report: dict[str, Any]) -> int | None:
    """The report's batch lines in flight (a report from before it was recorded at the top: its
    policies' resources; None if it has neither)."""
    if "batch_max_inflight" in report:
        return int(report["batch_max_inflight"])
    for e in report.get("policies", {}).values():
        if "batch_max_inflight" in e.get("resources", {}):
            return int(e["resources"]["batch_max_inflight"])
    return None


def merged(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """`new`'s policies added to an earlier report of the same method (a search split over two
    runs); refused when the engine, config, window or search differ."""
    keys = ("engine", "sim_step_model", "config", "set", "window", "violation", "repeats", "search")
    diff = [k for k in keys if old.get(k) != new.get(k)]
    if None not in (cap := (_batch_cap(old), _batch_cap(new))) and cap[0] != cap[1]:
        diff.append("batch_max_inflight")
    if diff:
        raise ValueError(f"--append: the earlier report differs in {diff}")
    out = {**new, "policies": {**old["policies"], **new["policies"]}}
    out["wall_s"] = old.get("wall_s", 0.0) + new["wall_s"]
    return out


def cpu_model() -> str:
    """The host CPU's model name (/proc/cpuinfo), or "unknown"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"
