"""Where no layout fits: the layouts that miss by the least, and what each lacks."""

from __future__ import annotations

from automodel.costing.gpus import GiB, GpuProfile


def nearest_misses(estimates: list[dict], gpu: GpuProfile, n: int = 3) -> list[dict]:
    """The ``n`` layouts that miss the GPU's memory by the least, each with what it lacks."""
    def short(e: dict) -> int:
        return max(-gpu.headroom(r["peak_bytes"]) for r in e["ranks"])

    out, shapes = [], set()
    for e in sorted(estimates, key=short):  # (one per mesh shape: its best settings)
        c = e["candidate"]
        shape = (c["pp"], c["schedule"], c["dp_replicate"], c["dp_shard"], c["tp"], c["cp"],
                 c["ep"])
        if shape in shapes:
            continue
        shapes.add(shape)
        out.append({**e, "short_bytes": short(e),
                    "lacks": f"{short(e) / GiB:.1f} GiB more per device (peak "
                             f"{e['peak_bytes'] / GiB:.1f} GiB + overhead on "
                             f"{gpu.hbm_bytes / GiB:.1f} GiB)"})
        if len(out) == n:
            break
    return out
