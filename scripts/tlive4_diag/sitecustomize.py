"""Diagnostic only (not product): with TLIVE4_DIAG_DIR set and this folder on PYTHONPATH, every
instance worker logs each step it runs: its plan (decodes, offline/online prefill tokens), the
step time its step model predicted for the plan, `tidal`'s strict budget when it packed offline
prefill, and the engine's measured step time; and every online token's wall time. One JSON line
each, in TLIVE4_DIAG_DIR/<pid>.jsonl. Used for docs/colocation.md (`tidal` live at 4 lines/s)."""

import json
import os
import time

_DIR = os.environ.get("TLIVE4_DIAG_DIR", "")


def _install() -> None:
    from services.instance import policy_adapter, worker
    from tidal.policy.batch_shape import add_decode, add_prefill
    from tidal.perf.api import BatchShape

    out = open(os.path.join(_DIR, f"{os.getpid()}.jsonl"), "a", buffering=1)  # noqa: SIM115
    budget = {"s": None}

    try:
        from tidal.policy.tidal import policy as tp

        orig_budget = tp.TidalPolicy.strict_budget

        def strict_budget(self, inst, now):  # type: ignore[no-untyped-def]
            b = orig_budget(self, inst, now)
            budget["s"] = b
            return b

        tp.TidalPolicy.strict_budget = strict_budget
    except ImportError:
        pass

    orig_plan = policy_adapter.PolicyAdapter.plan

    def plan(self, now):  # type: ignore[no-untyped-def]
        budget["s"] = None
        p = orig_plan(self, now)
        shape = BatchShape()
        on_pre = off_pre = 0
        for rid, n in p.prefill.items():
            r = self.reqs.get(rid)
            cached = r.num_computed_tokens if r is not None else 0
            shape = add_prefill(shape, n, cached)
            if r is not None and r.is_online:
                on_pre += n
            else:
                off_pre += n
        n_on = n_off = 0
        for rid in p.decode:
            r = self.reqs.get(rid)
            if r is None:
                continue
            shape = add_decode(shape, 1, r.num_computed_tokens)
            n_on += r.is_online
            n_off += not r.is_online
        self._diag = {
            "plan_s": now,
            "role": self.inst.role.value,
            "pred_s": self.inst.step_model.step_s(shape) if (p.prefill or p.decode) else 0.0,
            "budget_s": budget["s"],
            "dec_on": n_on,
            "dec_off": n_off,
            "pre_on": on_pre,
            "pre_off": off_pre,
            "n_pre": len(p.prefill),
        }
        return p

    policy_adapter.PolicyAdapter.plan = plan

    orig_account = worker.Instance._account

    def _account(self, out_, plan_, fcfs):  # type: ignore[no-untyped-def]
        res = out_
        if isinstance(res, worker.Ran):
            res = res.execution
        res = getattr(res, "result", res)
        tel = getattr(res, "telemetry", None)
        if tel is not None:
            d = dict(getattr(self.adapter, "_diag", {}))
            d.update(
                ev="step",
                id=self.id,
                end_s=time.time(),
                step_s=tel.step_s,
                tel_pre=tel.num_prefill_tokens,
                tel_dec=tel.num_decode_tokens,
                tel_ctx=tel.num_context_tokens,
            )
            out.write(json.dumps(d) + "\n")
        return orig_account(self, out_, plan_, fcfs)

    worker.Instance._account = _account

    orig_tokens = policy_adapter.PolicyAdapter.on_tokens

    def on_tokens(self, req_id, now, num_tokens):  # type: ignore[no-untyped-def]
        r = self.reqs.get(req_id)
        if r is not None and r.is_online and num_tokens > 0:
            out.write(
                json.dumps(
                    {
                        "ev": "tok",
                        "id": self.instance_id,
                        "req": req_id,
                        "t": now,
                        "n": num_tokens,
                        "k": r.num_output_tokens,
                        "N": r.max_output_tokens,
                    }
                )
                + "\n"
            )
        return orig_tokens(self, req_id, now, num_tokens)

    policy_adapter.PolicyAdapter.on_tokens = on_tokens


if _DIR:
    import importlib.abc
    import sys

    class _Hook(importlib.abc.MetaPathFinder):
        """Patch `services.instance.worker` right after it runs (only instance processes)."""

        def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
            if name != "services.instance.worker":
                return None
            sys.meta_path.remove(self)
            import importlib.util

            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module

            def exec_module(module):  # type: ignore[no-untyped-def]
                run(module)
                _install()

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Hook())
