"""Accelerator profiles: the published numbers of a GPU that the planner's memory check and
step-time model (``cost.py``) read. Torch-free.

Every number is per GPU. Bandwidths are unidirectional bytes per second: NVLink's published
bidirectional figure halved, and the node's network share per GPU (one 400 Gb/s NIC per GPU is
50e9 B/s). The sources and the reasons for the defaults are in docs/planning.md
("GPU profiles").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from automodel.config.build import ConfigError

MiB = 1024**2
GiB = 1024**3


@dataclass(frozen=True)
class GpuProfile:
    """One accelerator, as the planner sees it."""

    name: str
    peak_bf16_flops: float  # dense bf16 tensor-core FLOP/s (no sparsity)
    hbm_bytes: int  # device memory, as nvidia-smi reports its total
    hbm_bandwidth: float  # B/s
    intra_node_bandwidth: float  # NVLink, per GPU, one direction, B/s
    inter_node_bandwidth: float  # the node's network per GPU, one direction, B/s
    gpus_per_node: int = 8
    # achieved / peak FLOP/s over a transformer step, fitted to a published training run on
    # this GPU (benchmarks/published_runs.py; docs/planning.md, "GPU profiles")
    compute_efficiency: float = 0.30
    comm_efficiency: float = 0.75  # achieved bus bandwidth / link bandwidth
    overhead_bytes: int = 3 * GiB  # what no tensor tracker sees: CUDA context, NCCL, ...
    overhead_fraction: float = 0.05  # ... plus allocator fragmentation, a share of the peak

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "name" and not (value > 0 or (f.name.startswith("overhead")
                                                       and value == 0)):
                raise ConfigError(f"GPU profile {self.name!r}: {f.name}={value!r} must be > 0")
        for key in ("compute_efficiency", "comm_efficiency", "overhead_fraction"):
            if getattr(self, key) > 1:
                raise ConfigError(f"GPU profile {self.name!r}: {key}={getattr(self, key)!r} "
                                  "is a fraction: at most 1")

    def overhead(self, peak_bytes: int) -> int:
        """The stated overhead on top of ``peak_bytes`` of live tensors: the constant plus the
        fragmentation share."""
        return int(self.overhead_bytes + self.overhead_fraction * peak_bytes)

    def headroom(self, peak_bytes: int) -> int:
        """Bytes left on the GPU at the peak (negative: short by that much)."""
        return self.hbm_bytes - peak_bytes - self.overhead(peak_bytes)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


_NVLINK4 = 450e9  # NVLink 4 (H100, H200): 900 GB/s bidirectional per GPU
_NDR_PER_GPU = 50e9  # one ConnectX-7 400 Gb/s NIC per GPU (DGX H100, H200, B200)

PROFILES: dict[str, GpuProfile] = {
    p.name: p for p in (
        # torchtitan's Llama-3.1-8B FSDP on 8 H100s (5,762 tokens/s/GPU): 0.306
        GpuProfile("h100_80gb", peak_bf16_flops=989.4e12, hbm_bytes=81559 * MiB,
                   hbm_bandwidth=3.35e12, intra_node_bandwidth=_NVLINK4,
                   inter_node_bandwidth=_NDR_PER_GPU, compute_efficiency=0.30),
        # this project's 0.95B Llama, FSDP2 on one H200 (47.9k tokens/s): 0.281
        GpuProfile("h200", peak_bf16_flops=989.4e12, hbm_bytes=143771 * MiB,
                   hbm_bandwidth=4.8e12, intra_node_bandwidth=_NVLINK4,
                   inter_node_bandwidth=_NDR_PER_GPU, compute_efficiency=0.28),
        # torchtitan's Llama-3-8B FSDP on 64 A100s (2,904 tokens/s/GPU): 0.49 for the compute
        GpuProfile("a100_80gb", peak_bf16_flops=312e12, hbm_bytes=81920 * MiB,
                   hbm_bandwidth=2.039e12, intra_node_bandwidth=300e9,  # NVLink 3: 600 GB/s
                   inter_node_bandwidth=25e9,  # one ConnectX-6 200 Gb/s per GPU (DGX A100)
                   compute_efficiency=0.48),
        # no published bf16 run: H100's fit carried over by published FP8 runs (CARRIED_OVER)
        GpuProfile("b200", peak_bf16_flops=2.25e15, hbm_bytes=183359 * MiB,
                   hbm_bandwidth=8e12, intra_node_bandwidth=900e9,  # NVLink 5: 1.8 TB/s
                   inter_node_bandwidth=_NDR_PER_GPU, compute_efficiency=0.28),
    )
}

# profiles whose compute_efficiency no published bf16 run of that GPU supports: how it was
# found instead (a plan's note says so; benchmarks/published_runs.py, TRANSFERS)
CARRIED_OVER = {
    "b200": "H100's fitted figure scaled by the share of H100's utilization that B200 keeps in "
            "one framework's published FP8 runs of Llama-3-8B on 8 GPUs (Megatron-Bridge: "
            "0.306 x 0.93 = 0.285)",
}

_FIELDS = tuple(f.name for f in dataclasses.fields(GpuProfile) if f.name != "name")


def profile(name: str, **overrides) -> GpuProfile:
    """The shipped profile ``name`` with any field replaced by ``overrides`` (a measured
    bandwidth, a PCIe variant's numbers, 4 GPUs per node...)."""
    if name not in PROFILES:
        raise ConfigError(f"plan.gpu={name!r} is not a known GPU profile; use one of "
                          f"{', '.join(sorted(PROFILES))} (and override its numbers)")
    unknown = sorted(set(overrides) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"GPU profile {name!r} has no field {', '.join(unknown)}; "
                          f"the fields are {', '.join(_FIELDS)}")
    base = PROFILES[name]
    return dataclasses.replace(base, **{k: _number(name, k, v, type(getattr(base, k)))
                                        for k, v in overrides.items()})


def _number(name: str, key: str, value, kind: type):
    """``value`` as the field's type (int or float), or a ConfigError naming the key."""
    if isinstance(value, bool):
        value = str(value)  # not a number: refused below
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"GPU profile {name!r}: {key}={value!r} must be a number") from None
    if kind is int:
        if number != int(number):
            raise ConfigError(f"GPU profile {name!r}: {key}={value!r} must be a whole number")
        return int(number)
    return number
