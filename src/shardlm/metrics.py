"""Throughput, MFU and memory, reported to the console, OUT/metrics.jsonl and TensorBoard.

MFU (model FLOPs utilisation, Chowdhery et al. 2022) = tokens/s x FLOPs per token / the device's peak,
where FLOPs per token = 6 x (parameters that do a matmul per token, i.e. all but the input and position
embeddings) + 12 x layers x heads x head_dim x seq (attention scores and values, forward and backward,
counting the full causal square as torchtitan and Megatron do; see ModelConfig.flops_per_token).
Recomputation does not change model FLOPs: MFU counts useful work only. The peak is the dense 16-bit
tensor-core rate of the GPU (looked up by name) or train.peak_tflops; on a CPU with no peak given, MFU
is not reported.
"""
from __future__ import annotations

import errno
import json
import math
import os
import re
import time
from pathlib import Path

import torch

from .config import RunError
from .extras import broken_line, is_missing
from .runtime.progress import duration

# Dense bf16/fp16 tensor-core peaks from the vendors' datasheets, by the model as torch.cuda.get_device_name
# spells it, variants first: a whole-word match ("NVIDIA L40" is no L4, "RTX A1000" no A100, "GH200" no H200),
# and the PCIe/NVL boards of a chip run at lower clocks than its SXM part.
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200 NVL", 835.0), ("H100", 989.0), ("H200", 989.0),
    ("H800", 989.0), ("GH200", 989.0), ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0),
    ("L40", 181.0), ("L4", 121.0), ("A10G", 125.0), ("A10", 125.0), ("V100", 125.0), ("RTX 4090", 165.0),
    ("RTX 3090", 71.0),
)


def card_peak_tflops(name: str) -> float | None:
    """The dense 16-bit peak of the card `name` names; None for one not in the table (no MFU is shown: a
    wrong peak would show a wrong one)."""
    words = re.sub(r"[^A-Za-z0-9]+", " ", name).upper().split()
    for key, tflops in PEAK_TFLOPS:
        wanted = key.upper().split()
        if any(words[i:i + len(wanted)] == wanted for i in range(len(words))):
            return tflops
    return None


def peak_flops(device: torch.device, override_tflops: float = 0.0) -> float | None:
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type == "cuda" and (tflops := card_peak_tflops(torch.cuda.get_device_name(device))):
        return tflops * 1e12
    return None


def memory_gib(device: torch.device) -> float:
    """Peak device memory allocated since the last reset (CUDA); process RSS high-water mark on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    except ImportError:  # pragma: no cover - non-POSIX
        return 0.0


def _step_of(line: str) -> int | None:
    """The step of one metrics.jsonl line; None for one that does not read, as a kill or a full disk leaves the
    last one cut short: the run it belongs to must still resume."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record.get("step", 0) if isinstance(record, dict) else None


class MetricsLogger:
    def __init__(self, out_dir: Path | None, enabled: bool, tensorboard: bool, resume_step: int | None = None,
                 warn=print):
        self.enabled = enabled and out_dir is not None
        self.warn, self.failing = warn, False
        self.path = out_dir / "metrics.jsonl" if self.enabled else None
        self.tb = None
        if not self.enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        events = list((out_dir / "tensorboard").glob("events.out.tfevents.*"))
        if resume_step is not None and self.path.is_file():
            # A run resumed into its own directory: its history up to the checkpoint stays, and what the
            # abandoned future logged after it goes (here and, by purge_step, in TensorBoard).
            self._keep_up_to(resume_step)
        elif resume_step is None:
            self.path.unlink(missing_ok=True)
            # An earlier run's events (it left no checkpoint to resume) would show as this run's steps.
            for old in events:
                old.unlink()
        # A resume with TensorBoard off still marks the purge in the events an earlier stretch left: else the
        # abandoned future's steps show again beside this stretch's once a later one turns TensorBoard back on.
        if tensorboard or (resume_step is not None and events):
            try:
                from torch.utils.tensorboard import SummaryWriter
            except Exception as e:  # noqa: BLE001 - installed but broken (a protobuf its generated code predates)
                # On by default: a user expecting TensorBoard would find no events and no word why; and an optional
                # log whose import raised otherwise than ImportError stopped every run before its first step.
                if tensorboard and is_missing(e, "tensorboard", "torch.utils.tensorboard"):
                    warn("warning: no TensorBoard events will be written: the tensorboard package is not installed "
                         "(pip install tensorboard, or pip install 'shardlm[tensorboard]'); set train.tensorboard "
                         "false to silence this")
                elif tensorboard:
                    warn("warning: no TensorBoard events will be written: " + broken_line(
                        "train.tensorboard", "tensorboard", e) + ", or set train.tensorboard false to silence this")
                return
            purge = None if resume_step is None else resume_step + 1
            self.tb = SummaryWriter(str(out_dir / "tensorboard"), purge_step=purge)
            if not tensorboard:
                self._drop_tensorboard()  # the purge it wrote is all this stretch adds

    def _keep_up_to(self, step: int) -> None:
        """Written beside and renamed over metrics.jsonl: a kill or a full disk mid-write once left it empty or
        cut short, the run's whole history lost."""
        kept = [line for line in self.path.read_text().splitlines() if (s := _step_of(line)) is not None and s <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            with open(tmp, "w") as f:
                f.write("".join(line + "\n" for line in kept))
                f.flush()
                os.fsync(f.fileno())  # renamed over the old file before its data reach the disk, a crash empties it
            os.replace(tmp, self.path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise RunError(f"dropping the steps after step {step} from {self.path} failed ({e.strerror or e}); it is "
                           "as it was: free space (or fix its directory) and resume again") from None

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        # Strict JSON: a value that is not finite is written as null (json.dumps would write a bare NaN).
        finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        self._append((json.dumps(finite, allow_nan=False) + "\n").encode(), record["step"])
        if self.tb is not None:
            try:
                for k, v in record.items():
                    if k != "step" and isinstance(v, (int, float)):
                        self.tb.add_scalar(k if "/" in k else f"train/{k}", v, record["step"])
                self.tb.flush()
            except OSError as e:  # its writer thread is dead after a failed write: no more TensorBoard this run
                self.warn(f"warning: TensorBoard's event file could not be written ({e.strerror or e}): TensorBoard "
                          f"is off for the rest of the run, from step {record['step']}")
                self._drop_tensorboard()

    def _append(self, line: bytes, step) -> None:
        """A full disk (or a quota) once ended the run with a traceback at this write, its steps since the last
        save lost, and left the record cut short. The record is dropped whole and the run goes on: its next save
        fails with a message if the disk is still full, and succeeds if space was freed meanwhile."""
        try:
            with open(self.path, "ab", buffering=0) as f:
                at = f.seek(0, 2)
                try:
                    if f.write(line) != len(line):  # a short write: the disk filled within the line
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                except OSError:
                    f.truncate(at)  # no line cut short for readers of the file to stop on
                    raise
        except OSError as e:
            if not self.failing:
                full = e.errno in (errno.ENOSPC, errno.EDQUOT)
                self.warn(f"warning: {self.path} could not be written ({e.strerror or e}): step {step}'s metrics, and "
                          "those of the steps after it until it can be, are not recorded"
                          + ("; free space before the next checkpoint save, which would fail too" if full else ""))
            self.failing = True
            return
        self.failing = False

    def _drop_tensorboard(self) -> None:
        tb, self.tb = self.tb, None
        try:
            tb.close()
        except OSError:
            pass

    def close(self) -> None:
        if self.tb is not None:
            try:
                self.tb.close()
            except OSError as e:
                self.warn(f"warning: TensorBoard's event file could not be written at the end ({e.strerror or e})")


def format_line(r: dict) -> str:
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
    loss = "-" if r["loss"] is None else f"{r['loss']:.4f}"  # a step skipped for lack of trained tokens
    norm = "-" if r["grad_norm"] is None else f"{r['grad_norm']:.3f}"
    return (f"step {r['step']:>6} | loss {loss} | grad-norm {norm} | lr {r['lr']:.2e} | "
            f"{r['tokens_per_s']:,.0f} tok/s | mfu {mfu} | mem {r['mem_gib']:.2f} GiB"
            + (f" | skipped {r['skipped_steps']}" if r.get("skipped_steps") else "")
            # fp16's overflows: the scale beside them tells a settling scale from one that keeps backing off
            + (f" (loss scale {r['loss_scale']:g})" if r.get("skipped_steps") and r.get("loss_scale") else "")
            + (f" | untrained {r['untrained_steps']}" if r.get("untrained_steps") else "")
            + (f" | disk {r['disk_gb_s']:.2f} GB/s" if r.get("disk_gb_s") is not None else "") + _moe(r))


class Eta:
    """` | eta 1h02m` for the console line where no progress bar shows it (a log file, a pipe, a scheduler's
    output): the mean step time since this process's first logged step (its start-up left out), times the
    steps left."""

    def __init__(self, total: int, shown: bool):
        self.total, self.shown, self.start = total, shown, None

    def __call__(self, step: int) -> str:
        now = time.perf_counter()
        if self.start is None:
            self.start = (step, now)
        done = step - self.start[0]
        if not self.shown or not done or step >= self.total:
            return ""
        return f" | eta {duration((now - self.start[1]) / done * (self.total - step))}"


def _moe(r: dict) -> str:
    """The MoE layers in one part: the worst layer's max / mean expert load (and expert-parallel rank load), the
    dropped token copies (and their share of those routed) and the forwards run in chunks past
    parallel.ep_load_budget summed over the layers (per layer in metrics.jsonl and TensorBoard, keys
    moe/layer{i}/...)."""
    loads = [v for k, v in r.items() if k.startswith("moe/") and k.endswith("/max_over_mean")]
    if not loads:
        return ""
    dropped = sum(v for k, v in r.items() if k.startswith("moe/") and k.endswith("/dropped"))
    ranks = [v for k, v in r.items() if k.startswith("moe/") and k.endswith("/ep_max_over_mean")]
    chunked = sum(v for k, v in r.items() if k.startswith("moe/") and k.endswith("/chunked"))
    routed = sum(v for k, v in r.items() if k.startswith("moe/") and k.endswith("/routed"))
    # a count alone, summed over layers and the steps since the last log, said nothing of how much was lost
    share = f" ({100 * dropped / routed:.1f}%)" if routed else ""
    return (f" | moe max/mean {max(loads):.2f}" + (f" (ranks {max(ranks):.2f})" if ranks else "")
            + (f" dropped {dropped}{share}" if dropped else "") + (f" chunked {chunked}" if chunked else ""))
