"""Trace-driven simulation of expert caching and CPU/device splitting (the SpecMD approach).

- `trace`: the routing-trace file format, `TraceWriter` (called by the live loop once per
  verification step) and `read_trace` (validating reader).
- `synthetic`: a routing generator calibrated to published Qwen3-30B-A3B decode statistics.
- `locality`: token-level locality statistics (repeat rates, per-layer LRU/Belady curves).
- `profiles`: hardware and model profiles, loaded from `orchestrator/profiles/*.toml`.
- `simulator`: replays a trace through a policy (`orchestrator.policies`) under a cost model.
- `experiments`, `plots`, `cli`: the `spac sim` sub-app (tables and PNG plots).
"""

from orchestrator.sim.trace import Trace, TraceError, TraceWriter, read_trace

__all__ = ["Trace", "TraceError", "TraceWriter", "read_trace"]
