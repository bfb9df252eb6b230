"""GPU profiles, which mesh axes cross nodes, the step-time model on hand-computed numbers, and
the plan's picture. Pure Python, no process group."""

import struct

import pytest

from automodel.config.build import ConfigError
from automodel.config.layout import Layout
from automodel.costing import cost
from automodel.costing.cost import (
    axis_spans_nodes,
    collective_seconds,
    job_step_time,
    mesh_sizes,
    step_time,
)
from automodel.costing.gpus import PROFILES, GiB, MiB, profile
from automodel.planning.picture import OVERHEAD, UNATTRIBUTED, draw_plan, memory_bars, time_bars

pytestmark = pytest.mark.fast

B = 1e9  # bytes of a collective's tensor


def test_profiles_lookup_overrides_and_errors():
    h100 = profile("h100_80gb")
    assert h100 == PROFILES["h100_80gb"] and h100.hbm_bytes == 81559 * MiB
    assert set(PROFILES) == {"h100_80gb", "h200", "a100_80gb", "b200"}
    assert PROFILES["a100_80gb"].peak_bf16_flops < h100.peak_bf16_flops < \
        PROFILES["b200"].peak_bf16_flops
    tuned = profile("h100_80gb", compute_efficiency=0.6, gpus_per_node="4",
                    inter_node_bandwidth=25e9)
    assert (tuned.compute_efficiency, tuned.gpus_per_node, tuned.inter_node_bandwidth) == \
        (0.6, 4, 25e9)
    assert isinstance(tuned.gpus_per_node, int) and h100.gpus_per_node == 8  # a copy
    with pytest.raises(ConfigError, match=r"plan.gpu='h100'.*a100_80gb, b200, h100_80gb, h200"):
        profile("h100")
    with pytest.raises(ConfigError, match=r"no field peak_flops; the fields are "
                                          r"peak_bf16_flops, hbm_bytes"):
        profile("h200", peak_flops=1e15)
    with pytest.raises(ConfigError, match=r"gpus_per_node='many' must be a number"):
        profile("h200", gpus_per_node="many")
    with pytest.raises(ConfigError, match=r"gpus_per_node=2.5 must be a whole number"):
        profile("h200", gpus_per_node=2.5)
    with pytest.raises(ConfigError, match=r"compute_efficiency=1.5 is a fraction"):
        profile("h200", compute_efficiency=1.5)
    with pytest.raises(ConfigError, match=r"hbm_bandwidth=0.0 must be > 0"):
        profile("h200", hbm_bandwidth=0)
    # overhead: the constant plus the fragmentation share; headroom what is left
    peak = 60 * GiB
    assert h100.overhead(peak) == int(h100.overhead_bytes + h100.overhead_fraction * peak)
    assert h100.headroom(peak) == h100.hbm_bytes - peak - h100.overhead(peak)
    assert profile("h100_80gb", overhead_bytes=0, overhead_fraction=0).headroom(peak) == \
        h100.hbm_bytes - peak


@pytest.mark.parametrize("sizes, axis, across", [
    ({"tp": 8, "dp_shard": 2}, "tp", False),  # tp=8 fills a node of 8
    ({"tp": 8, "dp_shard": 2}, "dp_shard", True),  # dp over the two nodes
    ({"tp": 16}, "tp", True),  # tp=16 crosses
    ({"dp_shard": 8}, "dp_shard", False),  # one node
    ({"tp": 4, "dp_shard": 2}, "dp_shard", False),  # 2 x 4 = 8
    ({"dp_replicate": 2, "dp_shard": 8}, "dp_shard", False),  # HSDP: shard inside,
    ({"dp_replicate": 2, "dp_shard": 8}, "dp_replicate", True),  # replicate across
    ({"dp_replicate": 2, "dp_shard": 8}, "dp", True),
    ({"pp": 4, "tp": 8}, "pp", True),
    ({"pp": 4, "tp": 8}, "world", True),
    ({"dp_shard": 2, "cp": 4, "cp_ulysses": 2, "tp": 2}, "cp_ulysses", False),
    ({"dp_shard": 2, "cp": 4, "cp_ulysses": 2, "tp": 2}, "cp", False),  # 4 x tp 2 = 8
    ({"dp_shard": 2, "cp": 4, "cp_ulysses": 2, "tp": 2}, "dp_shard_cp", True),
    ({"dp_shard": 16, "ep": 8}, "ep", False),  # ep innermost of the regrouped ranks
    ({"dp_shard": 16, "ep": 8}, "ep_shard", True),
    ({"dp_shard": 16, "ep": 16}, "ep", True),
    ({"tp": 3, "dp_shard": 4}, "tp", True),  # ranks 6, 7, 8: the third group straddles
    ({"tp": 2, "dp_shard": 3}, "dp_shard", False),  # 6 ranks: one node
    ({"tp": 8}, "ranks 0,3", False),  # a group the planner names by its ranks
    ({"tp": 8, "pp": 2}, "ranks 4,12", True),
])
def test_axis_spans_nodes(sizes, axis, across):
    assert axis_spans_nodes(sizes, axis, gpus_per_node=8) is across


def test_layout_objects_and_unknown_axes():
    layout = Layout(pp=2, dp_replicate=2, dp_shard=2, cp=4, cp_ulysses=2, tp=2, ep=4)
    assert mesh_sizes(layout) == mesh_sizes(
        {"pp": 2, "dp_replicate": 2, "dp_shard": 2, "cp_ring": 2, "cp_ulysses": 2, "tp": 2,
         "ep": 4})
    for axis in (*cost.BASE_AXES, *cost.FLATTENED, "ep", "ep_shard"):  # Layout's own sizes
        assert cost.axis_extent(layout, axis)[0] == layout.size(axis)
    assert cost.axis_extent(layout, "ep_shard") == (8, 4)  # 32 ranks a stage / ep 4
    assert cost.axis_extent(layout, "world")[0] == layout.world_size == 64
    with pytest.raises(ValueError, match=r"unknown mesh axis 'fsdp'; the axes are pp, "):
        axis_spans_nodes({"tp": 8}, "fsdp", 8)
    with pytest.raises(ValueError, match=r"ep=3 must divide dp\*cp\*tp=8"):
        mesh_sizes({"dp_shard": 8, "ep": 3})


def test_ring_collectives_on_hand_computed_numbers():
    bw, n = 100e9, 8
    assert collective_seconds("all_reduce", B, n, bw) == pytest.approx(2 * 7 / 8 * B / bw)
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        assert collective_seconds(kind, B, n, bw) == pytest.approx(7 / 8 * B / bw)
    for kind in ("send", "recv", "broadcast"):
        assert collective_seconds(kind, B, n, bw) == pytest.approx(B / bw)
    assert collective_seconds("all_reduce", B, 1, bw) == 0  # a group of one sends nothing
    with pytest.raises(ValueError, match="unknown collective kind 'gather'"):
        collective_seconds("gather", B, n, bw)


def test_step_time_overlap_bandwidth_and_bubble():
    gpu = profile("h100_80gb")
    nvlink = gpu.intra_node_bandwidth * gpu.comm_efficiency
    network = gpu.inter_node_bandwidth * gpu.comm_efficiency
    rate = gpu.peak_bf16_flops * gpu.compute_efficiency
    ar = 2 * 7 / 8 * B  # bus bytes of an all-reduce of B over 8 ranks
    # tp=8 inside a node: its all-reduce is on the critical path, after the compute
    t = step_time(1e15, {"tp": {"all_reduce": B}}, {"tp": 8}, gpu)
    assert t.compute_s == pytest.approx(1e15 / rate)
    assert t.comm_s == {"tp": pytest.approx(ar / nvlink)}
    assert t.exposed_comm_s == pytest.approx(ar / nvlink) and t.overlapped_comm_s == 0
    assert t.step_time_s == pytest.approx(1e15 / rate + ar / nvlink) and t.bubble_s == 0
    # tp=16 crosses nodes: the network's bandwidth, 2*15/16*B
    t16 = step_time(0, {"tp": {"all_reduce": B}}, {"tp": 16}, gpu)
    assert t16.step_time_s == pytest.approx(2 * 15 / 16 * B / network)
    # FSDP's gathers and reduce-scatters hide behind compute; only the excess shows
    fsdp = {"dp_shard": {"all_gather": 2 * B, "reduce_scatter": B}}
    hidden = 7 / 8 * 3 * B / nvlink
    assert step_time(0, fsdp, {"dp_shard": 8}, gpu).exposed_comm_s == pytest.approx(hidden)
    long = step_time(10 * hidden * rate, fsdp, {"dp_shard": 8}, gpu)
    assert long.overlapped_comm_s == pytest.approx(hidden) and long.exposed_comm_s == 0
    assert long.step_time_s == pytest.approx(long.compute_s)
    half = step_time(hidden / 2 * rate, fsdp, {"dp_shard": 8}, gpu)
    assert half.exposed_comm_s == pytest.approx(hidden / 2)
    # pipeline: pp=2 across nodes, a send and a receive at once cost one; the bubble stretches
    # the busy time to busy / (1 - bubble)
    pipe = step_time(1e15, {"pp": {"send": B, "recv": B}}, {"pp": 2, "tp": 8}, gpu, bubble=0.2)
    busy = 1e15 / rate + B / network
    assert pipe.exposed_comm_s == pytest.approx(B / network)
    assert pipe.step_time_s == pytest.approx(busy / 0.8)
    assert pipe.bubble_s == pytest.approx(busy / 0.8 - busy)
    assert job_step_time([t, pipe, t16]) is pipe
    with pytest.raises(ValueError, match=r"bubble=1.0 must be a fraction in \[0, 1\)"):
        step_time(1e15, {}, {"pp": 2}, gpu, bubble=1.0)


def test_calibration_overrides_the_profile():
    gpu = profile("h100_80gb")
    comm, sizes = {"tp": {"all_reduce": B}}, {"tp": 8}
    plain = step_time(1e15, comm, sizes, gpu)
    measured = step_time(1e15, comm, sizes, gpu, calibration={
        "compute_efficiency": 0.9, "bandwidth": {"tp": 100e9}})
    assert measured.compute_s == pytest.approx(plain.compute_s * gpu.compute_efficiency / 0.9)
    assert measured.comm_s["tp"] == pytest.approx(2 * 7 / 8 * B / 100e9)  # measured busbw
    slower_links = step_time(1e15, comm, sizes, gpu, calibration={"comm_efficiency": 0.5})
    assert slower_links.comm_s["tp"] == pytest.approx(
        plain.comm_s["tp"] * gpu.comm_efficiency / 0.5)
    calibration = {"bandwidth": {"tp": 1e11}}
    assert cost.check_calibration(calibration) == calibration  # returns a copy
    for bad, message in (({"efficiency": 0.5}, r"no key efficiency; the keys are"),
                         ({"compute_efficiency": 0}, r"compute_efficiency=0 must be a fraction"),
                         ({"bandwidth": {"tp": -1}}, r"bandwidth.tp=-1 must be > 0")):
        with pytest.raises(ConfigError, match=message):
            step_time(1e15, comm, sizes, gpu, calibration=bad)


def _plan(gpu) -> dict:
    def rank(name, params, acts, peak_extra, time):
        memory = {"parameters_sharded": params, "gradients": params, "optimizer_states": 2 * params,
                  "activations": acts, "temporary": 1 * GiB}
        return {"name": name, "count": 8, "example_rank": 0, "stages": [0],
                "peak_bytes": sum(memory.values()) + peak_extra, "memory": memory,
                "flops": 10**15, "comm_bytes_per_step": {}, "time": time,
                "overhead_bytes": gpu.overhead(sum(memory.values()))}
    time = {"compute_s": 1.0, "exposed_comm_s": 0.25, "bubble_s": 0.3}
    return {"world_size": 16, "layout": {"pp": 2, "dp_shard": 8, "tp": 1},
            "model": {"name": "llama-3.1-8b", "parameters": 8 * 10**9},
            "gpu": gpu.as_dict(), "ranks": [rank("stage 0", 4 * GiB, 30 * GiB, 0, time),
                                            rank("stage 1", 5 * GiB, 20 * GiB, 2 * GiB, time)],
            "bubble": 0.2, "step_time_s": 1.55, "time": time, "tokens_per_s": 1e5,
            "overhead_bytes": gpu.overhead_bytes, "fits": True, "warnings": []}


def test_picture_bars_and_png(tmp_path):
    gpu = profile("h100_80gb")
    plan = _plan(gpu)
    labels, bars = memory_bars(plan)
    assert labels == ["stage 0\n(x8)", "stage 1\n(x8)"]
    assert list(bars) == ["parameters_sharded", "gradients", "optimizer_states", "activations",
                          "temporary", UNATTRIBUTED, OVERHEAD]
    assert bars["activations"] == [30, 20] and bars[UNATTRIBUTED] == [0, 2]
    assert bars[OVERHEAD] == [r["overhead_bytes"] / GiB for r in plan["ranks"]]
    assert time_bars(plan) == (labels, {"compute_s": [1.0, 1.0], "exposed_comm_s": [0.25, 0.25],
                                        "bubble_s": [0.3, 0.3]})
    job = {**plan, "ranks": [{k: v for k, v in r.items() if k != "time"} for r in plan["ranks"]]}
    assert time_bars(job) == (["job"], {"compute_s": [1.0], "exposed_comm_s": [0.25],
                                        "bubble_s": [0.3]})
    for name, p in (("ranks.png", plan), ("job.png", job)):
        path = tmp_path / name
        assert draw_plan(p, path) == path
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
        width, height = struct.unpack(">II", data[16:24])
        assert width >= 1000 and height >= 500 and len(data) > 20_000  # two drawn panels
