"""Which probes a search runs: its base probes, then only the keys whose layouts could still
rank among the fastest (branch and bound).

A probe costs two or three simulations (seconds each). With context and expert parallelism a search
of hundreds of GPUs has hundreds of probe keys, and most of their layouts cannot win. So the
search probes the *base* keys first: no context parallelism, no HSDP and, for a mixture of
experts, ep 1 and the largest ep of each (tp, checkpointing). Every other key's layouts are
estimated *optimistically* from its base:

- context parallelism divides what grows with a rank's tokens by cp: the activations, the
  rest's per-sequence peak, the FLOPs and the activations' traffic (tp, cp, ep); cp's own
  traffic (the keys' and values' exchange) and buffers are left out;
- a smaller ep than the base's takes the base's costs: ep changes only the experts' gathered
  weights and their traffic (E / ep per layer), of which the base has less;
- a base probed without its run of two sequences (none of its own layouts takes more than one
  sequence a micro-batch) does not split the rest's peak into what grows with the micro-batch and
  what does not: its whole / cp is the least of both;
- HSDP takes the costs of FSDP over its shards: the replicas' reduction (its traffic and
  buffers) is left out (the experts' state, sharded over the replicas too, is scaled to the
  key's shards exactly: ``search._sharded``).

So an optimistic estimate is at most as slow and as large as the key's own. A key is probed
when one of its layouts, so estimated, fits and is faster than the ``keep``-th fastest layout
estimated from its own probe by more than ``MARGIN``: the most promising first, a batch at a
time, until no such key is left. A layout of a key never probed is therefore not faster than
the ``keep``-th by more than ``MARGIN`` (2%: near-ties, common among the layouts that differ
only in overlapped traffic, such as ep's, would otherwise each cost a probe).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Callable

from automodel.planning.probes import ACTIVATION_AXES, LayerCosts, ProbeKey

MARGIN = 0.02


def base_key(key: ProbeKey, keys) -> ProbeKey:
    """The probe ``key`` is estimated from until it is probed itself: no cp, no HSDP, and the
    largest ep of its (tp, checkpointing, sequence parallelism) among ``keys``."""
    ep = 1
    if key.ep > 1:
        ep = max(k.ep for k in keys if (k.tp, k.ac, k.sp) == (key.tp, key.ac, key.sp))
    return dataclasses.replace(key, cp=1, ep=ep, replicated=False)


def optimistic(costs: LayerCosts, key: ProbeKey) -> LayerCosts:
    """``costs`` (of ``key``'s base) made at most the costs of ``key``'s own probe."""
    def per_token(comm: dict) -> dict:
        return {axis: {k: (v / cp if axis in ACTIVATION_AXES else v) for k, v in kinds.items()}
                for axis, kinds in comm.items()}
    cp = key.cp
    out = costs
    if cp > 1:
        out = dataclasses.replace(
            out, layer_activation=out.layer_activation / cp, rest_peak=out.rest_peak / cp,
            layer_flops=out.layer_flops / cp, rest_flops=out.rest_flops / cp,
            layer_comm=per_token(out.layer_comm), rest_comm=per_token(out.rest_comm))
    if not costs.rest_split:  # (not split by a run of two sequences: of a micro-batch of
        # any size, the rest's peak is at least the whole of it / cp)
        out = dataclasses.replace(out, rest_fixed=(costs.rest_fixed + costs.rest_peak) / cp,
                                  rest_peak=0.0, rest_split=True)
    return out


@dataclasses.dataclass
class Probed:
    estimates: list  # every layout estimated from its own probe
    costs: dict  # ProbeKey -> LayerCosts, every probe run
    pruned: int  # layouts left out: their optimistic estimate did not fit or was too slow


def probe_and_estimate(found: list, probe: Callable[[list], dict],
                       estimate: Callable, keep: int, batch: int) -> Probed:
    """Estimates of the layouts ``found`` that could rank among the ``keep`` fastest: the
    base probes, then the most promising other keys, ``batch`` at a time.
    ``probe(keys, wide) -> {key: LayerCosts}`` (``wide``: the keys whose layouts take
    micro-batches of more than one sequence); ``estimate(candidate, costs) -> dict``."""
    by_key = defaultdict(list)
    for c in found:
        by_key[c.probe].append(c)
    wide = {k for k, cs in by_key.items() if any(c.mbs > 1 for c in cs)}
    base = {k: base_key(k, by_key) for k in by_key}
    costs = probe(sorted(set(base.values())), wide)
    estimates = [estimate(c, costs[k]) for k in by_key if k in costs for c in by_key[k]]
    hope = {k: _best_fitting(estimate(c, optimistic(costs[base[k]], k)) for c in by_key[k])
            for k in by_key if k not in costs}
    while True:
        bar = _kth_fastest(estimates, keep)
        waiting = sorted((t, k) for k, t in hope.items()
                         if t < bar * (1 - MARGIN) and k not in costs)
        if not waiting:
            break
        batch_keys = [k for _, k in waiting[:batch]]
        costs.update(probe(batch_keys, wide))
        estimates += [estimate(c, costs[k]) for k in batch_keys for c in by_key[k]]
    pruned = sum(len(cs) for k, cs in by_key.items() if k not in costs)
    return Probed(estimates, costs, pruned)


def _best_fitting(estimates) -> float:
    return min((e["step_time_s"] for e in estimates if e["fits"]), default=math.inf)


def _kth_fastest(estimates: list, k: int) -> float:
    times = sorted(e["step_time_s"] for e in estimates if e["fits"])
    return times[k - 1] if len(times) >= k else math.inf
