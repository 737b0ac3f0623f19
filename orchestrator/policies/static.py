"""Static placement, llama.cpp `--n-cpu-moe N` style: the experts of the first N MoE layers stay
on the host, those of the other layers on the device, for the whole run.

`n_cpu_moe=None` fills the pool with whole layers from the last one down (as many as the
expert pool holds), which is how one picks N for a given VRAM budget.
"""

from __future__ import annotations

import numpy as np

from orchestrator.policies.base import Feedback, Policy, PolicyContext, keep_plan
from orchestrator.policies.plan import Plan, StepRouting


class StaticPlacement(Policy):
    name = "static"
    miss = "cpu"

    def __init__(self, n_cpu_moe: int | None = None) -> None:
        self.n_cpu_moe = n_cpu_moe

    def reset(self, ctx: PolicyContext) -> None:
        """A pool over several devices (ctx.devices): whole layers per device, each device's
        from its last layer down as its slots allow (its slots hold only its own layers)."""
        super().reset(ctx)
        self.placement = np.zeros((ctx.n_layer, ctx.n_expert), dtype=bool)
        if self.n_cpu_moe is not None:
            self.placement[self.n_cpu_moe:] = True
        for first, end, slots in ctx.device_spans():
            if self.n_cpu_moe is None:
                on_device = min(slots // ctx.n_expert, end - first)
                self.placement[end - on_device:end] = True
            elif self.placement[first:end].sum() > slots:
                raise ValueError(f"--n-cpu-moe {self.n_cpu_moe} needs {self.placement[first:end].sum()} slots"
                                 f"{' on a device' if ctx.devices else ''}, the pool has {slots}")
        self.n_cpu = int((~self.placement.any(axis=1)).sum())

    def plan(self, routing: StepRouting | None, resident: np.ndarray, feedback: Feedback | None = None) -> Plan:
        return keep_plan(self.placement)
