"""The planner's numbers against closed-form formulas (Korthikanti et al., 2022, and the Llama
count of ``automodel/planning/closed_form.py``), for Llama 3.1 8B and 70B.

* **Activations of one layer, per sequence.** As ``automodel/planning/probes.py`` does: the
  job simulated with 4 and 5 decoder layers (FSDP2 over 64 ranks, so that model states stay
  small, pp 1); one layer = the difference of the tracker's activation bytes at the two
  peaks (``plan``); ``peak growth`` is the probes' own per-layer cost, the difference of the
  peaks less that of the kept states (activations plus what else grows with depth at the
  peak: under checkpointing, backward temporaries). A probe runs ``mbs`` sequences per
  micro-batch where one would leave the peak at the end of backward (where it measures
  gradients, not saved activations); the figure is divided by ``mbs`` (every saved tensor is
  proportional to it). A row whose two peaks are not in the same phase of the step (their
  gradients differ) is marked.
* **Model states and FLOPs per step**, from full plans (every layer): 8B on FSDP 8, 70B on
  FSDP 8 x TP 8 with sequence parallelism (64 ranks), each one sequence per rank.

Every simulation runs in a fresh process (``simulate_configs``). About 4 minutes on 2 cores.

    python benchmarks/plan_vs_closed_form.py [--json out.json] [--only-layers | --only-full]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

from automodel.planning.closed_form import (
    Dense,
    korthikanti_layer_bytes,
    llama_layer_bytes,
    model_state_bytes,
    training_flops,
)
from automodel.planning.depth import SHALLOW as PROBE_DEPTHS


@dataclass(frozen=True)
class LayerCase:
    model: str
    seq: int
    tp: int
    sp: bool
    ac: str
    mbs: int = 1  # sequences per micro-batch of the probe (the result is per sequence)

    @property
    def name(self) -> str:
        par = f"tp {self.tp}" + (" + SP" if self.sp else "")
        return f"{self.model} s={self.seq} {par}, AC {self.ac}"


LAYER_CASES = [
    LayerCase("llama3_1_8b", 8192, 1, False, "none"),
    LayerCase("llama3_1_8b", 8192, 1, False, "selective"),
    LayerCase("llama3_1_8b", 8192, 1, False, "full", 4),
    LayerCase("llama3_1_8b", 8192, 2, False, "none"),
    LayerCase("llama3_1_8b", 8192, 2, True, "none"),
    LayerCase("llama3_1_8b", 8192, 8, True, "none", 4),
    LayerCase("llama3_1_8b", 8192, 8, True, "selective", 4),
    LayerCase("llama3_1_8b", 8192, 8, True, "full", 16),
    LayerCase("llama3_1_70b", 4096, 8, True, "none", 8),
    LayerCase("llama3_1_70b", 4096, 8, True, "selective", 8),
    LayerCase("llama3_1_70b", 4096, 8, True, "full", 32),
]
PROBE_DP = 64


@dataclass(frozen=True)
class FullCase:
    model: str
    seq: int
    dp: int
    tp: int
    ac: str

    @property
    def name(self) -> str:
        return f"{self.model} s={self.seq} FSDP {self.dp}" + \
            (f" x TP {self.tp} + SP" if self.tp > 1 else "") + f", AC {self.ac}"


FULL_CASES = [FullCase("llama3_1_8b", 8192, 8, 1, "none"),
              FullCase("llama3_1_70b", 4096, 8, 8, "full")]


def overrides(model: str, seq: int, dp: int, tp: int, sp: bool, ac: str, mbs: int,
              layers: int | None = None) -> list[str]:
    out = [f"model={model}", "data=synthetic", "parallelism=fsdp2", "pipeline=none",
           f"mesh.dp_size={dp}", f"mesh.tp_size={tp}",
           f"parallelism.sequence_parallel={str(sp).lower()}",
           f"parallelism.activation_checkpointing={'false' if ac == 'none' else ac}",
           f"trainer.global_batch_size={dp * mbs}", f"trainer.local_batch_size={mbs}",
           f"trainer.seq_len={seq}"]
    return out + ([f"++model.config.num_hidden_layers={layers}"] if layers else [])


def _load(ov: list[str]):
    from automodel.api import load_config

    return load_config(ov, env={"CUDA_VISIBLE_DEVICES": ""})


def dense_of(cfg) -> Dense:
    return Dense.from_config(dict(cfg.model.config))


def _state(sim: dict) -> int:
    return sim["memory"]["parameters_sharded"] + sim["memory"]["optimizer_states"]


def layer_row(case: LayerCase, m: Dense, shallow: dict, deep: dict) -> dict:
    per_layer = (deep["peak_bytes"] - shallow["peak_bytes"]) - (_state(deep) - _state(shallow))
    act = deep["memory"]["activations"] - shallow["memory"]["activations"]
    clean = shallow["memory"]["gradients"] == deep["memory"]["gradients"]  # (same phase)
    a = m.heads
    return {"case": case.name, "mbs": case.mbs, "clean": clean,
            "memory": {"shallow": shallow["memory"], "deep": deep["memory"]},
            "paper": korthikanti_layer_bytes(case.seq, 1, m.hidden, a, case.tp, case.sp,
                                             case.ac),
            "paper_no_scores": korthikanti_layer_bytes(case.seq, 1, m.hidden, a, case.tp,
                                                       case.sp, case.ac, scores=False),
            "llama": llama_layer_bytes(m, case.seq, 1, case.tp, case.sp, case.ac),
            "plan": act / case.mbs, "peak_growth": per_layer / case.mbs}


def full_rows(case: FullCase, m: Dense, sim: dict) -> list[dict]:
    shards = case.dp * case.tp
    states = model_state_bytes(m.parameters(), shards)
    tokens = case.dp * case.seq  # one sequence per data-parallel rank
    world = case.dp * case.tp
    mem = sim["memory"]
    rows = [{"case": case.name, "what": "parameters (sharded)", "formula": states["parameters"],
             "plan": mem["parameters_sharded"]},
            {"case": case.name, "what": "optimizer states", "formula": states["optimizer_states"],
             "plan": mem["optimizer_states"]},
            {"case": case.name, "what": "gradients at the peak", "formula": states["gradients"],
             "plan": mem["gradients"]}]
    for label, kw in (("FLOPs/step, 6N + 12Lhs/2", {}),
                      ("FLOPs/step, flash backward + early stop",
                       {"flash_backward": True, "early_stop": True})):
        rows.append({"case": case.name, "what": label,
                     "formula": training_flops(m, case.seq, tokens, case.ac, **kw),
                     "plan": sim["flops"] * world})
    return rows


def run(layers: bool = True, full: bool = True, workers: int | None = 2) -> dict:
    from automodel.planning.plan import simulate_configs

    configs, ranks, jobs = [], [], []
    if layers:
        for c in LAYER_CASES:
            for depth in PROBE_DEPTHS:
                configs.append(_load(overrides(c.model, c.seq, PROBE_DP, c.tp, c.sp, c.ac,
                                               c.mbs, depth)))
            jobs.append(("layer", c))
    if full:
        for c in FULL_CASES:
            configs.append(_load(overrides(c.model, c.seq, c.dp, c.tp, c.tp > 1, c.ac, 1)))
            jobs.append(("full", c))
    ranks = [0] * len(configs)
    start = time.perf_counter()
    sims = simulate_configs(configs, ranks, workers=workers)
    out: dict = {"layers": [], "full": [], "seconds": 0.0}
    i = 0
    for kind, case in jobs:
        if kind == "layer":
            out["layers"].append(layer_row(case, dense_of(configs[i]), sims[i], sims[i + 1]))
            i += 2
        else:
            out["full"] += full_rows(case, dense_of(configs[i]), sims[i])
            i += 1
    out["seconds"] = time.perf_counter() - start
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def layer_table(rows: list[dict]) -> str:
    lines = ["| setting (one layer, one sequence, bf16) | paper, Table 2 | paper without 5as/h "
             "| Llama formula | plan | plan / Llama formula | plan / paper | peak growth |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = "" if r["clean"] else " (peak not in backward!)"
        probe = f" (probe mbs {r['mbs']})" if r["mbs"] > 1 else ""
        lines.append(f"| {r['case']}{probe}{mark} | {_mib(r['paper'])} | "
                     f"{_mib(r['paper_no_scores'])} | {_mib(r['llama'])} | {_mib(r['plan'])} | "
                     f"{r['plan'] / r['llama']:.4f} | {r['plan'] / r['paper']:.2f} | "
                     f"{_mib(r['peak_growth'])} |")
    return "\n".join(lines)


def full_table(rows: list[dict]) -> str:
    lines = ["| setting | quantity (per rank; FLOPs: whole job) | closed form | plan | "
             "plan / closed form |", "|---|---|---|---|---|"]
    for r in rows:
        flops = r["what"].startswith("FLOPs")
        fmt = (lambda n: f"{n:.4e}") if flops else _mib
        ratio = f"{r['plan'] / r['formula']:.4f}" if r["formula"] else "-"
        lines.append(f"| {r['case']} | {r['what']} | {fmt(r['formula'])} | {fmt(r['plan'])} "
                     f"| {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--only-layers", action="store_true")
    ap.add_argument("--only-full", action="store_true")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    result = run(not args.only_full, not args.only_layers, args.workers)
    if result["layers"]:
        print(layer_table(result["layers"]) + "\n")
    if result["full"]:
        print(full_table(result["full"]) + "\n")
    print(f"{result['seconds']:.0f} s of simulation")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all(r["clean"] for r in result["layers"]) else 1


if __name__ == "__main__":
    sys.exit(main())
