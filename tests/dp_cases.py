"""What the data-parallel tests share: the modes, the one-process reference and the comparison with it."""
import json

import pytest
import torch

import dist_fns

# Gradients are summed over ranks in another order than one process sums its micro-batches, so values
# differ in the last bits of fp32 and that difference compounds over steps through the optimizer.
RTOL, ATOL = 1e-5, 1e-6

MODES = {
    "classic": {"parallel.dp_mode": "classic"},
    "ddp": {},
    "zero1": {"parallel.zero_stage": "1"},
    "zero2": {"parallel.zero_stage": "2"},
    "zero3": {"parallel.zero_stage": "3", "parallel.persist_threshold": "100"},
    "zero2-offload": {"parallel.zero_stage": "2", "parallel.offload": "optimizer"},
    "zero3-offload": {"parallel.zero_stage": "3", "parallel.offload": "optimizer", "parallel.persist_threshold": "100"},
    "zero3-offload-params": {"parallel.zero_stage": "3", "parallel.offload": "params", "parallel.persist_threshold": "100"},
}


OFFLOADED = {"zero1-offload": {"parallel.zero_stage": "1", "parallel.offload": "optimizer"}}
OFFLOADED.update({m: MODES[m] for m in ("zero2-offload", "zero3-offload", "zero3-offload-params")})


def reference(overrides, device="cpu"):
    """The same training in this process, with the same micro-batches, on the device the ranks use."""
    return dist_fns.train_and_capture(0, 1, {"train.device": device, **overrides})


def check_trajectory(results, ref, atol=ATOL):
    """Every rank's losses and gradient norms, and the gathered masters, those of one process."""
    for r in results:
        torch.testing.assert_close(r["losses"], ref["losses"], rtol=RTOL, atol=0)
        torch.testing.assert_close(r["grad_norms"], ref["grad_norms"], rtol=RTOL, atol=0)
    masters = next(r["masters"] for r in results if r["masters"] is not None)
    assert masters.keys() == ref["masters"].keys()
    for name, value in ref["masters"].items():
        torch.testing.assert_close(masters[name], value, rtol=RTOL, atol=atol, msg=name)


def check_against_reference(results, ref, world, atol=ATOL):
    check_trajectory(results, ref, atol)
    for key in ("grad", "state"):
        covered = {}
        for r in results:
            for name, (lo, hi, got) in r[key].items():
                full_lo, full_hi, full = ref[key][name]
                assert (full_lo, full_hi) == (0, full.numel())
                torch.testing.assert_close(got, full[lo:hi], rtol=RTOL, atol=atol, msg=f"{key} {name}[{lo}:{hi}]")
                covered[name] = covered.get(name, 0) + hi - lo
        # Together the ranks own every element exactly once (sharded) or each holds all of it (replicated).
        for name, (_, _, full) in ref[key].items():
            assert covered.get(name, 0) in (full.numel(), world * full.numel()), (key, name, covered.get(name))


def equality_case(optimizer: str, world: int) -> dict:
    micro = 8 // (2 * world)  # two micro-batches per rank per step: accumulation is exercised
    return {"train.steps": "4", "train.global_batch_size": "8", "train.micro_batch_size": str(micro),
            "train.optimizer": optimizer, "train.lr": "1e-2" if optimizer == "sgd" else "3e-3"}


def gpus_for(world):
    """A copy-engine case: it needs `world` GPUs (peer-to-peer copies); skipped elsewhere."""
    return pytest.mark.skipif(torch.cuda.device_count() < world, reason=f"copy_engine needs {world} GPUs")


def on(algo: str) -> str:
    """Where a case runs: the copy engines on GPUs, every other algorithm on the CPU (gloo), as specified."""
    return "cuda" if algo == "copy_engine" else "cpu"


def read_metrics(path):
    return [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]
