"""A search's result in words: the printed summary, and a layout described in a line."""

from __future__ import annotations

from automodel.costing.gpus import GiB

CONFIRM_TRIES = 3  # estimates a search plans in full, fastest first, until one fits


def layout_words(c: dict) -> str:
    """A candidate (as search.json holds it) in words: ``pp 2 1f1b, dp 1x4, tp 2, ...``."""
    return (f"pp {c['pp']} {c['schedule']}, dp {c['dp_replicate']}x{c['dp_shard']}, "
            f"tp {c['tp']}, cp {c['cp']}, ep {c['ep']}, AC {c['ac']}, micro-batch {c['mbs']}")


def search_summary(result: dict) -> str:
    lines = [f"search: {result['searched']} layouts of {result['gpus']} x "
             f"{result['gpu']['name']}, {result.get('estimated', 0)} estimated from "
             f"{len(result.get('probes', {}))} probes ({result.get('pruned', 0)} left out: "
             f"they cannot be among the fastest), {result['fitting']} fit; the fastest:"]
    for i, e in enumerate(result["top"], 1):
        c = e["candidate"]
        lines.append(f" {i}. {e['step_time_s']:.3f} s/step, {e['tokens_per_s']:.0f} tokens/s, "
                     f"peak {e['peak_bytes'] / GiB:.1f} GiB ({layout_words(c)})\n"
                     f"    {e['command']}")
    for e in result.get("refused_in_full", []):
        p = e["planned"]
        lines.append(f" left out: estimated {e['peak_bytes'] / GiB:.1f} GiB, planned in full "
                     f"{p['peak_bytes'] / GiB:.1f} GiB: does not fit\n    {e['command']}")
    best = result.get("best_planned")
    if best:
        planned = ", ".join(best.get("ranks_planned", []))
        lines.append(f" #1 planned in full{f' ({planned})' if planned else ''}: "
                     f"{best['step_time_s']:.3f} s/step, peak {best['peak_bytes'] / GiB:.1f} "
                     f"GiB (estimated {best['estimated_peak_bytes'] / GiB:.1f}), fits")
    elif result["top"] or result.get("refused_in_full"):
        lines.append(f" none of the {CONFIRM_TRIES} fastest fits when planned in full: plan "
                     "the others one by one (their commands above)")
    for why, n in result.get("refused_before_launch", {}).items():
        lines.append(f" left out before the search: {n} layout{'s' if n > 1 else ''} the "
                     f"preflight refuses: {why}")
    return "\n".join(lines + [f"  note: {n}" for n in result.get("notes", [])])
