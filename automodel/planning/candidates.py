"""The layouts a search enumerates: every mesh shape of ``plan.gpus`` GPUs that the model and
the batch allow, with its schedule, checkpointing mode and micro-batch size.

- tp within a node, dividing the attention heads (and the key/value heads);
- cp within a node beside tp (tp x cp divides the GPUs of a node), where the model's attention
  can be split (the check train.py runs before launch) and each sequence cuts into 2 x cp equal
  chunks (each split over tp under sequence parallelism);
- pp up to the layers; dp = the rest, dividing the global batch;
- ep (mixture-of-experts models): 1, and every degree dividing the experts and the stage's
  dp x cp x tp ranks;
- HSDP: FSDP within a node's worth of ranks, replicated across the rest;
- the schedule (1F1B, or interleaved with 2 stages per rank), the micro-batch size (1, 2, 4
  sequences) at the job's global batch and the checkpointing mode (none, selective, full).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from automodel.config.layout import Layout
from automodel.planning.probes import ProbeKey, ac_value

AC_MODES = ("none", "selective", "full")
MICRO_BATCHES = (1, 2, 4)


@dataclass(frozen=True)
class Candidate:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    schedule: str  # none | 1f1b | interleaved
    ac: str
    mbs: int  # sequences per micro-batch
    cp: int = 1
    ep: int = 1
    sp: bool = True  # sequence parallelism where tp > 1 (off for mixture-of-experts models)

    @property
    def probe(self) -> ProbeKey:
        """The probe it is estimated from (``probes.run_probes``' key)."""
        return ProbeKey(self.tp, self.ac, self.dp_replicate > 1, self.cp, self.ep,
                        self.sp and self.tp > 1)

    @property
    def layout(self) -> Layout:
        return Layout(pp=self.pp, dp_replicate=self.dp_replicate, dp_shard=self.dp_shard,
                      cp=self.cp, tp=self.tp, ep=self.ep)

    def overrides(self) -> list[str]:
        out = [f"mesh.dp_size={self.dp_replicate * self.dp_shard}", f"mesh.tp_size={self.tp}"]
        out += [f"mesh.{k}_size={v}" for k, v in (("cp", self.cp), ("ep", self.ep)) if v > 1]
        out += [f"parallelism.activation_checkpointing={ac_value(self.ac)}"]
        out += [f"mesh.dp_replicate_size={self.dp_replicate}"] if self.dp_replicate > 1 else []
        out += ["parallelism.sequence_parallel=true"] if self.probe.sp else []
        if self.pp > 1:
            return out + [f"pipeline={self.schedule}", f"mesh.pp_size={self.pp}",
                          f"pipeline.pp_microbatch_size={self.mbs}"]
        return out + ["pipeline=none", f"trainer.local_batch_size={self.mbs}"]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(gpus: int, gpus_per_node: int, model: dict, global_batch: int,
               seq_len: int) -> list[Candidate]:
    """Every layout of ``gpus`` that the model (``model_facts``) and the batch allow."""
    out = []
    for tp, cp in _model_parallel(gpus_per_node, model, seq_len):
        for pp in [p for p in divisors(gpus // (tp * cp)) if p <= model["layers"]]:
            dp = gpus // (tp * cp * pp)
            if global_batch % dp:
                continue
            for ep in _expert_degrees(model.get("experts", 0), dp * cp * tp):
                for replicate in _replicas(dp, tp * cp, gpus_per_node):
                    shape = dict(dp_replicate=replicate, dp_shard=dp // replicate, tp=tp,
                                 pp=pp, cp=cp, ep=ep, sp=not model.get("moe", False))
                    out += _schedules(shape, model["layers"], global_batch // dp)
    return out


def _model_parallel(gpus_per_node: int, model: dict, seq_len: int) -> list[tuple[int, int]]:
    """(tp, cp) within a node: tp divides the heads; cp cuts each sequence in 2 x cp equal
    chunks (where the model's attention allows it), each split over tp under sequence
    parallelism."""
    out = []
    for tp in [t for t in divisors(gpus_per_node)
               if model["heads"] % t == 0 and model["kv_heads"] % t == 0]:
        sp = tp > 1 and not model.get("moe", False)
        for cp in divisors(gpus_per_node // tp):
            if cp > 1 and (not model.get("context_parallel") or seq_len % (2 * cp)):
                continue
            if not sp or (seq_len // cp) % tp == 0:
                out.append((tp, cp))
    return out


def _expert_degrees(experts: int, stage_ranks: int) -> list[int]:
    """1 (experts sharded with the rest), and every ep dividing the experts and the stage's
    dp x cp x tp ranks (none for a dense model)."""
    return [1] + ([e for e in divisors(math.gcd(experts, stage_ranks)) if e > 1] if experts
                  else [])


def _schedules(shape: dict, layers: int, per_rank: int) -> list[Candidate]:
    """The schedules, micro-batch sizes and checkpointing modes of one mesh shape: a pipeline
    needs at least pp micro-batches per step, interleaving two stages per rank."""
    pp = shape["pp"]
    out = []
    for schedule in (("1f1b", "interleaved") if pp > 1 else ("none",)):
        if schedule == "interleaved" and layers < 2 * pp:
            continue
        for mbs in MICRO_BATCHES:
            if per_rank % mbs or (pp > 1 and per_rank // mbs < pp):
                continue
            out += [Candidate(schedule=schedule, ac=ac, mbs=mbs, **shape) for ac in AC_MODES]
    return out


def _replicas(dp: int, model_parallel: int, gpus_per_node: int) -> list[int]:
    """1 (FSDP over every data-parallel rank), and HSDP sharding within a node when that
    splits dp (each replica a node's worth of ranks: dp_shard x cp x tp of them)."""
    shard = gpus_per_node // model_parallel if gpus_per_node % model_parallel == 0 else 0
    return [1] + ([dp // shard] if shard and dp % shard == 0 and 1 < shard < dp else [])


def admitted(found: list, admit, gpus: int) -> tuple[list, dict]:
    """(the candidates the preflight would let start, {refusal: layouts it took})."""
    from automodel.config.build import ConfigError

    if admit is None:
        return found, {}
    refused: dict[str, int] = {}
    kept = []
    for c in found:
        why = admit(c)
        if why is None:
            kept.append(c)
        else:
            refused[why] = refused.get(why, 0) + 1
    if not kept:
        reasons = "; ".join(f"{why} ({n} layouts)" for why, n in
                            sorted(refused.items(), key=lambda kv: -kv[1])[:3])
        raise ConfigError(f"every layout of {gpus} ranks that the search weighs is refused "
                          f"before launch for this job: {reasons}")
    return kept, refused
