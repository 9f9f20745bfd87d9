"""tandem — the co-location policy: RT keeps its TTFT/TPOT targets, BE gets the rest, in one
per-iteration loop (synthesis §4). One module per concept:

* `policy`    the loop (plan / observe)
* `rt_phase`  RT decodes, slack order, τ, urgent prompts, best-fit window, ERA
* `be_phase`  BE in the time and KV RT leaves; skippable decodes; deadline BE first
* `slack`     deadlines, slack, urgency, allowances, the time an urgent prompt needs
* `admission` per-key output-length histories, Past-Future future peak, RT headroom
* `victims`   eviction order (BE least progress, then least urgent RT, never urgent RT)
* `feedback`  AIMD on the safety margin ε and the BE time share
* `queues`    incremental waiting queues (no per-iteration re-sort)
* `batch`, `timing`  the batch being planned and fast latency-model arithmetic
* `config`    the knobs, with the ablation switches

Import each name from the module that defines it: `TandemPolicy` from `policy`, `TandemConfig`
from `config`.
"""
