"""Static placement, llama.cpp `--n-cpu-moe N` style: the experts of the first N MoE layers stay
on the host, those of the other layers on the device, for the whole run.

`n_cpu_moe=None` fills the pool with whole layers from the last one down (as many as the
expert pool holds), which is how one picks N for a given VRAM budget.
"""

from __future__ import annotations

import numpy as np

from orchestrator.plan import Plan, StepRouting
from orchestrator.policies.base import Feedback, Policy, PolicyContext, keep_plan


class StaticPlacement(Policy):
    name = "static"
    miss = "cpu"

    def __init__(self, n_cpu_moe: int | None = None) -> None:
        self.n_cpu_moe = n_cpu_moe

    def reset(self, ctx: PolicyContext) -> None:
        super().reset(ctx)
        on_device = min(ctx.capacity // ctx.n_expert, ctx.n_layer)
        n_cpu = ctx.n_layer - on_device if self.n_cpu_moe is None else self.n_cpu_moe
        if (ctx.n_layer - n_cpu) * ctx.n_expert > ctx.capacity:
            raise ValueError(f"--n-cpu-moe {n_cpu} needs {(ctx.n_layer - n_cpu) * ctx.n_expert} slots, "
                             f"the pool has {ctx.capacity}")
        self.placement = np.zeros((ctx.n_layer, ctx.n_expert), dtype=bool)
        self.placement[n_cpu:] = True
        self.n_cpu = n_cpu

    def plan(self, routing: StepRouting | None, resident: np.ndarray, feedback: Feedback | None = None) -> Plan:
        return keep_plan(self.placement)
