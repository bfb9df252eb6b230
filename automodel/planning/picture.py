"""The plan's picture: memory per rank class as stacked bars against the GPU's memory, and the
step split into compute, exposed communication and bubble. Reads a plan dict (plan.json's
shape, docs/planning.md); torch-free, matplotlib's Agg backend (no display). ``draw_sweep``:
a sweep report's measured-vs-planned bars (``sweep_report.py``)."""

from __future__ import annotations

GiB = 1024**3
TIME_PARTS = (("compute_s", "compute", "#4C72B0"),
              ("exposed_comm_s", "exposed communication", "#DD8452"),
              ("bubble_s", "pipeline bubble", "#BBBBBB"))
OVERHEAD = "overhead (stated)"
UNATTRIBUTED = "other (unattributed)"


def memory_bars(plan: dict) -> tuple[list[str], dict[str, list[float]]]:
    """(bar labels, category -> GiB per rank class): the ``memory`` categories in the order
    they first appear, the rest of ``peak_bytes`` they do not explain, and the stated
    overhead (the rank's ``overhead_bytes``, else the plan's)."""
    ranks = plan["ranks"]
    labels = [_label(r) for r in ranks]
    categories: list[str] = []
    for r in ranks:
        categories += [c for c in r.get("memory", {}) if c not in categories]
    bars = {c: [r.get("memory", {}).get(c, 0) / GiB for r in ranks] for c in categories}
    rest = [max(0, r.get("peak_bytes", 0) - sum(r.get("memory", {}).values())) / GiB
            for r in ranks]
    if any(rest):
        bars[UNATTRIBUTED] = rest
    bars[OVERHEAD] = [r.get("overhead_bytes", plan.get("overhead_bytes", 0)) / GiB
                      for r in ranks]
    return labels, bars


def time_bars(plan: dict) -> tuple[list[str], dict[str, list[float]]]:
    """(bar labels, time part -> seconds): one bar per rank class when each has its own
    ``time``, else one for the job (the plan's ``time``)."""
    ranks = plan.get("ranks", [])
    if ranks and all("time" in r for r in ranks):
        labels, times = [_label(r) for r in ranks], [r["time"] for r in ranks]
    else:
        labels, times = ["job"], [plan["time"]]
    return labels, {key: [t.get(key, 0.0) for t in times] for key, _, _ in TIME_PARTS}


def _label(rank: dict) -> str:
    count = rank.get("count")
    return rank["name"] + (f"\n(x{count})" if count else "")


def draw_plan(plan: dict, path) -> str:
    """Draw ``plan`` to a PNG at ``path`` and return ``path``."""
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    n = max(len(plan["ranks"]), 1)
    fig, (mem_ax, time_ax) = plt.subplots(
        1, 2, figsize=(min(30.0, max(10.0, 4 + 2.2 * n)), 5.5),
        gridspec_kw={"width_ratios": [max(n, 2), max(len(time_bars(plan)[0]), 2)]})
    _draw_memory(mem_ax, plan)
    _draw_time(time_ax, plan)
    fig.suptitle(_title(plan))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _draw_memory(ax, plan: dict) -> None:
    labels, bars = memory_bars(plan)
    _stack(ax, labels, bars, colours={OVERHEAD: "#DDDDDD", UNATTRIBUTED: "#999999"},
           hatch={OVERHEAD: "//"})
    gpu = plan.get("gpu") or {}
    if gpu.get("hbm_bytes"):
        ax.axhline(gpu["hbm_bytes"] / GiB, color="black", linestyle="--", linewidth=1.2,
                   label=f"{gpu.get('name', 'GPU')} memory ({gpu['hbm_bytes'] / GiB:.1f} GiB)")
    ax.set_ylabel("GiB per GPU at the peak")
    ax.set_title("memory per rank class")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _draw_time(ax, plan: dict) -> None:
    labels, bars = time_bars(plan)
    named = {key: (name, colour) for key, name, colour in TIME_PARTS}
    _stack(ax, labels, {named[k][0]: v for k, v in bars.items()},
           colours={name: colour for name, colour in named.values()})
    ax.set_ylabel("seconds per step")
    ax.set_title("step time")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _stack(ax, labels: list[str], bars: dict[str, list[float]], colours: dict,
           hatch: dict | None = None) -> None:
    """Stacked bars, one per label, one segment per entry of ``bars`` (bottom first)."""
    import matplotlib.pyplot as plt

    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    bottom = [0.0] * len(labels)
    for i, (name, heights) in enumerate(bars.items()):
        ax.bar(range(len(labels)), heights, bottom=bottom, label=name, edgecolor="black",
               linewidth=0.5, color=colours.get(name, cycle[i % len(cycle)]),
               hatch=(hatch or {}).get(name))
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_xlim(-0.6, len(labels) - 0.4)


def _title(plan: dict) -> str:
    model = (plan.get("model") or {}).get("name", "model")
    gpu = (plan.get("gpu") or {}).get("name", "GPU")
    layout = plan.get("layout") or {}
    shape = " x ".join(f"{k} {v}" for k, v in layout.items() if v and v != 1) or "one rank"
    parts = [f"{model} on {plan.get('world_size', '?')} x {gpu} ({shape})"]
    if "step_time_s" in plan:
        parts.append(f"step {plan['step_time_s']:.3g} s")
    if plan.get("tokens_per_s"):
        parts.append(f"{plan['tokens_per_s']:,.0f} tokens/s")
    if "fits" in plan:
        parts.append("fits" if plan["fits"] else "DOES NOT FIT")
    return ", ".join(parts)


def draw_sweep(rep: dict, path) -> str:
    """A sweep report's picture (``sweep_report.report``'s dict, docs/planning.md "Sweep
    report"): measured and planned peak memory per layout (and rank class), and tokens/s."""
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    n, jobs = sum(len(r["classes"]) or 1 for r in rep["jobs"]), len(rep["jobs"])
    fig, (mem, tok) = plt.subplots(1, 2, figsize=(min(30.0, max(10.0, 2 + 1.4 * (n + jobs))),
                                                  5.5), gridspec_kw={"width_ratios": [n, jobs]})
    _draw_sweep_memory(mem, rep)
    _draw_sweep_tokens(tok, rep)
    fig.suptitle(f"sweep {rep['sweep_dir']}: measured vs planned", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _draw_sweep_memory(ax, rep: dict) -> None:
    bars = [(_sweep_tick(r) + ("\n" + c["name"].replace(" (", "\n(") if len(r["classes"]) > 1
                               else ""), c)
            for r in rep["jobs"] for c in r["classes"] or [None]]
    top = max([(c or {}).get(k) or 0 for _, c in bars
               for k in ("measured_peak_bytes", "planned_peak_bytes")] + [1])
    unit, name = (GiB, "GiB") if top >= GiB else (2**20, "MiB")
    xs = range(len(bars))
    for dx, key, label in ((-0.2, "measured_peak_bytes", "measured peak_tensor_bytes"),
                           (0.2, "planned_peak_bytes", "planned peak")):
        ax.bar([x + dx for x in xs], [((c or {}).get(key) or 0) / unit for _, c in bars],
               0.4, label=label, edgecolor="black", linewidth=0.5)
    for x, (_, c) in zip(xs, bars):
        if c and c["error"] is not None:
            ax.annotate(f"{100 * c['error']:+.1f}%", (x + 0.2, c["planned_peak_bytes"] / unit),
                        ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs), [b[0] if b[1] else b[0] + "\n(no data)" for b in bars],
                  fontsize=7)
    ax.set_ylabel(f"{name} per rank at the peak (largest rank of the class)")
    ax.set_title("peak memory (labels: planned / measured - 1)", fontsize=9)
    ax.legend(fontsize=7)


def _draw_sweep_tokens(ax, rep: dict) -> None:
    jobs = rep["jobs"]
    series = [("measured_tokens_per_s", "measured")]
    series += [("planned_tokens_per_s", "planned")] if rep["planned_time_shown"] else []
    width = 0.8 / len(series)
    for i, (key, label) in enumerate(series):
        ax.bar([x - 0.4 + width * (i + 0.5) for x in range(len(jobs))],
               [j[key] or 0 for j in jobs], width, label=label, edgecolor="black",
               linewidth=0.5)
    ax.set_xticks(range(len(jobs)), [_sweep_tick(j) + ("" if j["measured_tokens_per_s"] else
                                                 "\n(no data)") for j in jobs], fontsize=7)
    ax.set_ylabel("tokens/s (whole job)")
    ax.set_title("throughput" + ("" if rep["planned_time_shown"] else
                                 " (measured only: the cost model is for GPUs)"), fontsize=9)
    ax.legend(fontsize=7)


def _sweep_tick(row: dict) -> str:
    """A job's bar label: its number, then each swept override on a line (shortened)."""
    parts = [o if len(o) <= 30 else o[:29] + "…" for o in row["layout"].split()]
    return "\n".join([f"#{row['job']}", *parts])
