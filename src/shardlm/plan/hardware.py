"""Accelerator and interconnect figures the planner uses, from the vendors' datasheets.

Peaks are dense 16-bit tensor-core rates; bandwidths are per GPU, in bytes/s. NVLink is the per-GPU
one-direction rate (a ring collective moves data at about this rate per link), half the datasheet's
"NVLink bandwidth", which counts both directions; the network is the per-GPU NIC rate of a typical
cluster of the card's generation (one NIC per GPU: 400 Gb/s for Hopper and Blackwell, 200 Gb/s for
Ampere and the L40S, 100 Gb/s for Volta). Every figure can be overridden.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

GiB = 2**30


@dataclass(frozen=True)
class GPU:
    name: str
    memory: float          # bytes
    peak_flops: float      # dense bf16/fp16 FLOP/s
    hbm_bw: float          # bytes/s
    nvlink_bw: float       # bytes/s per GPU, one direction, inside a node
    network_bw: float      # bytes/s per GPU across nodes
    # Offload's figures (plan/offload.py): PCIe per GPU and direction, pinned copies; the node's host memory
    # streaming rate and its local NVMe's, shared by the node's ranks. PCIe and host memory as measured on a
    # 2x H200 host of 32 cores (bench/README.md: pinned copies 55 GB/s; host memory as the compiled CPU
    # AdamW streams it, 150 GB/s, fitted on the 7B and 8B offload steps); NVMe that of a Gen4 drive.
    pcie_bw: float = 55e9
    host_bw: float = 150e9
    disk_bw: float = 6e9


GPUS = {
    "h100": GPU("H100 SXM 80GB", 80e9, 989e12, 3.35e12, 450e9, 50e9),
    "h200": GPU("H200 SXM 141GB", 141e9, 989e12, 4.8e12, 450e9, 50e9),
    "a100": GPU("A100 SXM 80GB", 80e9, 312e12, 2.0e12, 300e9, 25e9, pcie_bw=25e9),
    "a100-40gb": GPU("A100 SXM 40GB", 40e9, 312e12, 1.55e12, 300e9, 25e9, pcie_bw=25e9),
    # The export-control variants: the same chip and memory, NVLink cut to 400 GB/s (A800 SXM against the
    # A100's 600; H800 SXM against the H100's 900, the "half" the press reported), per their datasheets.
    "a800": GPU("A800 SXM 80GB", 80e9, 312e12, 2.0e12, 200e9, 25e9, pcie_bw=25e9),
    "h800": GPU("H800 SXM 80GB", 80e9, 989e12, 3.35e12, 200e9, 50e9),
    # V100 SXM2 32GB: 125 TFLOP/s is its fp16 tensor-core peak (Volta has no bf16: plan it with --precision
    # fp16), 900 GB/s HBM2, NVLink 300 GB/s both directions.
    "v100": GPU("V100 SXM2 32GB", 32e9, 125e12, 0.9e12, 150e9, 12.5e9, pcie_bw=12e9),
    "l40s": GPU("L40S 48GB", 48e9, 362e12, 0.864e12, 32e9, 25e9, pcie_bw=25e9),
    "b200": GPU("B200 180GB", 180e9, 2250e12, 8e12, 900e9, 50e9),
}


def parse_bytes(text: str, flag: str = "") -> float:
    """'80GiB', '80GB', '3.35TB/s', '1e12' -> bytes (or bytes/s); `flag` names the option in the error."""
    t = text.strip().removesuffix("/s").replace(" ", "")
    units = {"TiB": 2**40, "GiB": 2**30, "MiB": 2**20, "TB": 1e12, "GB": 1e9, "MB": 1e6, "B": 1}
    mult = next((m for unit, m in units.items() if t.endswith(unit)), 1)
    number = next((t[:-len(unit)] for unit in units if t.endswith(unit)), t)
    try:
        value = float(number) * mult
    except ValueError:
        value = -1.0
    if not (value > 0 and math.isfinite(value)):  # inf (or 1e400) planned NaN requests and Infinity tokens/s
        raise ValueError(f"{flag + ' ' if flag else ''}{text!r} is not a positive, finite size (e.g. 80GiB, 3.35TB/s, "
                         "1e12)")
    if number == t and value < 2**20:  # `--gpu-memory 80` was planned as 80 bytes: "0.00 GiB, DOES NOT FIT"
        raise ValueError(f"{flag + ' ' if flag else ''}{text!r} has no unit and is read as {value:g} bytes: give "
                         "one (e.g. 80GiB, 80GB, 3.35TB/s)")
    return value


# What a card of no known name must be given (--gpu-memory, --gpu-tflops, --hbm-bw); its links are a PCIe card's
# (L40S's) unless --nvlink-bw and --network-bw say otherwise.
CUSTOM = ("memory", "peak_flops", "hbm_bw")


def gpu(name: str, **overrides) -> GPU:
    """A known card, its figures replaced by `overrides` (its name then says which), or a card of another name
    from overrides of at least CUSTOM's."""
    given = {k: v for k, v in overrides.items() if v is not None}
    key = name.lower()
    if key not in GPUS:
        if all(k in given for k in CUSTOM):
            return replace(GPUS["l40s"], name=name, **given)
        raise ValueError(f"unknown --gpu {name!r} (known: {', '.join(GPUS)}): give its figures, --gpu-memory, "
                         "--gpu-tflops and --hbm-bw (and --nvlink-bw, --network-bw, --pcie-bw, --host-bw, --disk-bw "
                         "where they matter), or override a known card's")
    card = GPUS[key]
    if not given:
        return card
    return replace(card, name=f"{card.name} with {', '.join(FLAGS[k] for k in given)} given", **given)


FLAGS = {"memory": "--gpu-memory", "peak_flops": "--gpu-tflops", "hbm_bw": "--hbm-bw", "nvlink_bw": "--nvlink-bw",
         "network_bw": "--network-bw", "pcie_bw": "--pcie-bw", "host_bw": "--host-bw", "disk_bw": "--disk-bw"}
