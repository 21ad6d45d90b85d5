"""ZeRO-Offload's one-step delayed parameter update (`parallel.delayed_update`) against its definition, and its
checkpoints. (Offload's equality with the runs that keep everything on the device is in test_dp_equality.py.)"""
import gc
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import dist_fns
from shardlm.config import ConfigError, load_config, validate

SGD = {"train.optimizer": "sgd", "train.momentum": "0", "train.weight_decay": "0", "train.lr_schedule": "constant",
       "train.warmup_steps": "0", "train.grad_clip": "0", "train.lr": "0.05", "train.steps": "5",
       "train.global_batch_size": "4", "train.micro_batch_size": "2", "train.device": "cpu", "train.log_every": "1"}
DELAYED = {"parallel.zero_stage": "2", "parallel.offload": "optimizer", "parallel.delayed_update": "true"}


def gradient_at(oracle, weights: dict, k: int) -> tuple[dict, float]:
    """Batch k's mean gradient and loss at `weights`, by a plain trainer's own step code (its update skipped)."""
    with torch.no_grad():
        for name, p in oracle.model.named_parameters():
            p.copy_(weights[name])
    oracle.step = k - 1
    captured, real = {}, oracle.engine.optimizer_step

    def step(lr, n):  # the gradient captured, then a step of lr 0: the weights stay, the gradients are cleared
        captured["grad"] = oracle.engine.owned_shards("grad")
        real(0.0, n)
    oracle.engine.optimizer_step = step
    loss = float(oracle.train_step())
    oracle.engine.optimizer_step = real
    shapes = dict(oracle.model.named_parameters())
    return {name: values.reshape(shapes[name].shape) for name, (_, _, values) in captured["grad"].items()}, loss


ON_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (pinned memory, copy streams)")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ON_GPU)])
def test_the_delayed_update_is_its_definition(device):
    """SGD without momentum or decay at a constant lr, no clipping: update k applies, on top of update k - 1,
    batch k's gradient taken at the weights of update k - 2 (the start's for k = 1 and 2), so
    w_k = w_(k-1) - lr g_k(w_(k-2)); each step's loss is batch k's at w_(k-2). On a GPU the host thread,
    the double-buffered gradients and the staged weights run beside the device's streams; the update runs
    on the host there and the oracle's on the device, hence a looser tolerance."""
    sgd = {**SGD, "train.device": device}
    tol = 1e-6 if device == "cpu" else 1e-4
    delayed = dist_fns.tiny_trainer(1, {**sgd, **DELAYED})
    weights = {0: {n: p.detach().float().clone() for n, p in delayed.model.named_parameters()}}
    losses = [r["loss"] for r in delayed.run()]
    got, _ = delayed.parallel.gather_full_state()
    oracle = dist_fns.tiny_trainer(1, sgd)
    for k in range(1, 6):
        grad, loss = gradient_at(oracle, weights[max(k - 2, 0)], k)
        assert losses[k - 1] == pytest.approx(loss, rel=tol), k
        weights[k] = {n: w - 0.05 * grad[n].to(w.device) for n, w in weights[k - 1].items()}
    for name, want in weights[5].items():
        torch.testing.assert_close(got[name].cpu(), want.cpu(), rtol=10 * tol, atol=tol, msg=name)
    stale = dist_fns.tiny_trainer(1, sgd)  # and it is not the plain run
    assert [r["loss"] for r in stale.run()][2:] != pytest.approx(losses[2:], rel=tol)


def test_saving_a_delayed_update_run_changes_nothing_and_it_resumes_on_its_trajectory(tmp_path):
    """A checkpoint waits for the update in flight without landing it and keeps the weights one update behind:
    a run that saves equals one that does not, and a run resumed from its checkpoint continues it."""
    sgd = {k: v for k, v in SGD.items() if k != "train.momentum"}  # AdamW reads no momentum (refused if set)
    over = {**sgd, **DELAYED, "train.optimizer": "adamw", "train.steps": "6"}
    plain = dist_fns.train_and_capture(0, 1, over)
    saving = {**over, "train.save_every": "3", "train.keep_checkpoints": "5"}
    full = dist_fns.train_and_capture(0, 1, saving, str(tmp_path / "a"))
    resumed = dist_fns.train_and_capture(0, 1, saving, str(tmp_path / "b"),
                                         str(tmp_path / "a" / "checkpoints" / "step_00000003"))
    assert full["losses"] == plain["losses"]
    assert resumed["losses"] == pytest.approx(full["losses"][3:], rel=1e-6)
    for name, value in full["masters"].items():
        assert torch.equal(plain["masters"][name], value), name
        torch.testing.assert_close(resumed["masters"][name], value, rtol=1e-6, atol=1e-7, msg=name)


def test_a_delayed_update_run_that_ended_resumes_on_its_trajectory(tmp_path):
    """The save at a run's end (or at Ctrl-C) is a checkpoint like the others: landing the update first made
    the run continued with more steps take its first step on other weights than the run it continues."""
    sgd = {k: v for k, v in SGD.items() if k != "train.momentum"}
    over = {**sgd, **DELAYED, "train.optimizer": "adamw", "train.steps": "5", "train.save_every": "3"}
    full = dist_fns.train_and_capture(0, 1, over, str(tmp_path / "a"))
    dist_fns.train_and_capture(0, 1, {**over, "train.steps": "3"}, str(tmp_path / "b"))
    resumed = dist_fns.train_and_capture(0, 1, over, str(tmp_path / "b"), str(tmp_path / "b"))
    assert resumed["losses"] == pytest.approx(full["losses"][3:], rel=1e-6)



def slowed_update(monkeypatch, seconds: float, forward_waits: bool = True) -> None:
    """Each bucket's overlapped update takes `seconds` longer (and on a GPU its copy up waits behind a sleeping
    kernel), so that the next forward reaches buckets not yet updated; `forward_waits=False` takes forward's
    per-block waits away (the control: the test can fail)."""
    from shardlm.parallel import update_overlap, zero
    start = update_overlap.OverlappedUpdate.start

    def slow_start(self, buckets, update, land):
        def slow_update(b):
            time.sleep(seconds)
            update(b)

        def slow_land(b):
            if self.cuda:
                torch.cuda._sleep(int(seconds * 1e9))  # about `seconds` of GPU clock on this stream
            land(b)
        return start(self, buckets, slow_update, slow_land)
    monkeypatch.setattr(update_overlap.OverlappedUpdate, "start", slow_start)
    if not forward_waits:
        wait = zero.ZeroEngine._wait_weight_gathers
        monkeypatch.setattr(zero.ZeroEngine, "_wait_weight_gathers",
                            lambda self, at=None: None if at is not None else wait(self, at))


OVERLAP = {"parallel.zero_stage": "2", "parallel.offload": "optimizer", "train.optimizer": "adamw", "train.steps": "5",
           "train.global_batch_size": "4", "train.micro_batch_size": "2", "train.device": "cpu", "train.log_every": "1",
           "parallel.bucket_mb": "0.05"}


@pytest.mark.parametrize("stage,precision,device", [("2", "bf16", "cpu"), ("1", "fp32", "cpu"),
                                                    pytest.param("2", "bf16", "cuda", marks=ON_GPU)])
def test_the_overlapped_update_equals_the_update_in_place(stage, precision, device, tmp_path, monkeypatch):
    """`parallel.overlap_update`: the update runs bucket by bucket on a host thread while the next step's
    forward waits block by block for its weights; slowed down so that forward catches up with it. Between
    steps an evaluation (steps 2, 4), a checkpoint (step 3) and the end of training (step 5) each meet an
    update in flight: bit for bit the plain run, and a resumed run continues it."""
    over = {**OVERLAP, "parallel.zero_stage": stage, "train.precision": precision, "train.device": device,
            "train.eval_every": "2", "train.save_every": "3", "train.keep_checkpoints": "5"}
    plain = dist_fns.train_and_capture(0, 1, over, str(tmp_path / "plain"))
    slowed_update(monkeypatch, 0.02)
    on = {**over, "parallel.overlap_update": "true"}
    got = dist_fns.train_and_capture(0, 1, on, str(tmp_path / "overlap"))
    for key in ("losses", "grad_norms", "eval_losses"):
        assert got[key] == plain[key], key
    for name, value in plain["masters"].items():
        assert torch.equal(got["masters"][name], value), name
    for name, (_, _, value) in plain["state"].items():
        assert torch.equal(got["state"][name][2], value), name
    resumed = dist_fns.train_and_capture(0, 1, on, str(tmp_path / "resumed"),
                                         str(tmp_path / "overlap" / "checkpoints" / "step_00000003"))
    assert resumed["losses"] == got["losses"][3:]
    for name, value in got["masters"].items():
        assert torch.equal(resumed["masters"][name], value), name


def test_forward_reading_weights_before_their_overlapped_update_would_differ(monkeypatch):
    """The control for the test above: without forward's per-block waits (backward and the step still wait
    for all of it) the slowed update loses the race."""
    plain = dist_fns.train_and_capture(0, 1, OVERLAP)
    slowed_update(monkeypatch, 0.05, forward_waits=False)
    raced = dist_fns.train_and_capture(0, 1, {**OVERLAP, "parallel.overlap_update": "true"})
    assert raced["losses"][1:] != plain["losses"][1:]


@pytest.mark.timeout(120)
def test_a_failing_overlapped_update_raises_in_the_training_thread(monkeypatch):
    """An error on the update's thread reaches the training loop at the next wait for the weights (the next
    forward), never a hang on a bucket that will not arrive."""
    from shardlm.parallel import update_overlap
    start = update_overlap.OverlappedUpdate.start

    def failing_start(self, buckets, update, land):
        def fail(b):
            raise RuntimeError("host update failed")
        return start(self, buckets, fail, land)
    monkeypatch.setattr(update_overlap.OverlappedUpdate, "start", failing_start)
    with pytest.raises(RuntimeError, match="host update failed"):
        dist_fns.train_and_capture(0, 1, {**OVERLAP, "parallel.overlap_update": "true"})


def test_the_overlapped_update_needs_one_rank_s_optimizer_offload():
    for extra in ({"parallel.offload": "none"}, {"parallel.delayed_update": "true"}, {"parallel.zero_stage": "3"},
                  {"parallel.pp": "2", "parallel.zero_stage": "1"}):
        with pytest.raises(ConfigError, match="overlap_update"):
            validate(load_config("tiny", {**OVERLAP, "parallel.overlap_update": "true", **extra}),
                     int(extra.get("parallel.pp", 1)))


GPU_PAIRS = {  # (the run, the run it must equal, bit for bit or not)
    "zero2-offload": ({"parallel.offload": "optimizer"}, {}, False),
    "disk-tier": ({"parallel.offload": "optimizer", "parallel.offload_dir": "nvme"}, {"parallel.offload": "optimizer"},
                  True),
    "overlapped-update": ({"parallel.offload": "optimizer", "parallel.overlap_update": "true"},
                          {"parallel.offload": "optimizer"}, True),
    "zero3-offload-params": ({"parallel.zero_stage": "3", "parallel.offload": "params", "parallel.prefetch_units": "2",
                              "parallel.persist_threshold": "100"},
                             {"parallel.zero_stage": "3", "parallel.persist_threshold": "100"}, False),
}


@ON_GPU
@pytest.mark.parametrize("case", GPU_PAIRS)
def test_offload_on_a_gpu_equals_keeping_it_there(tmp_path, case):
    """The GPU paths of offload (gradient buckets copied to pinned memory on their own stream and accumulated
    there in fp32 over four micro-batches, the host step's weights copied back, ZeRO-3 units uploaded ahead
    of use, the disk tier's files) against the same bf16 run on one GPU without them. SGD, whose update
    does not magnify a rounding difference as Adam's does for a gradient near zero; the device and the host
    add in fp32 alike, so what differs is the order of the norm's sum and the update's arithmetic."""
    run, ref, exact = GPU_PAIRS[case]
    common = {**SGD, "train.device": "cuda", "train.precision": "bf16", "train.steps": "4", "train.global_batch_size": "8",
              "parallel.zero_stage": "2", "parallel.bucket_mb": "0.05"}
    fix = lambda over: {k: str(tmp_path / v) if k == "parallel.offload_dir" else v for k, v in over.items()}  # noqa: E731
    got, want = (dist_fns.train_and_capture(0, 1, {**common, **fix(over)}) for over in (run, ref))
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-3, "atol": 1e-5}
    for key in ("losses", "grad_norms"):
        torch.testing.assert_close(got[key], want[key], **tol)
    for name, value in want["masters"].items():
        torch.testing.assert_close(got["masters"][name], value, **tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("kernel", ["compiled", "torch"])
def test_host_gradients_add_16_bit_shards_in_fp32(kernel, monkeypatch):
    """Micro-batches' bf16 shards summed in the fp32 host buffer (in one compiled pass, or chunk by chunk past
    the conversion buffer's size), equal to adding them in fp32 at once; the last one's adds give the sum's
    sum of squares. `torch`: as without a C compiler."""
    from shardlm import cpu_adam
    from shardlm.parallel.offload import HostGradients
    if kernel == "torch":
        monkeypatch.setattr(cpu_adam, "load", lambda: None)
    elif cpu_adam.load() is None:
        pytest.skip("no C compiler")
    torch.manual_seed(0)
    host = torch.zeros(3 * 2**19 + 5)
    parts = [host[:7], host[7:]]
    acc = HostGradients(parts, torch.device("cpu"))
    shards = [[torch.randn(p.numel()).bfloat16() for p in parts] for _ in range(3)]
    for k, micro_batch in enumerate(shards):
        if k == len(shards) - 1:
            acc.last_micro_batch()  # its adds take the sum's squares too
        for b, shard in enumerate(micro_batch):
            acc.add(b, shard)
    acc.wait()
    for b, p in enumerate(parts):
        assert torch.equal(p, sum(m[b].float() for m in shards))
    total = acc.sum_of_squares(torch.device("cpu"))
    assert total.item() == pytest.approx(sum((p.double() ** 2).sum().item() for p in parts), rel=1e-6)


SGD_KEYS = {k: v for k, v in SGD.items() if k not in ("train.device", "train.global_batch_size", "train.micro_batch_size",
                                                      "train.steps")}


FULL = {"train.recompute": "full", "train.steps": "3", "train.global_batch_size": "4", "train.micro_batch_size": "2",
        "train.device": "cpu"}


@pytest.mark.parametrize("case", ["plain", "zero2-offload", "lora"])
def test_offloaded_activations_equal_full_recomputation(case):
    """`parallel.offload_activations`: each block's input kept in host memory until its backward (on the CPU
    a copy, through the same checkpoint and hooks): the same losses, gradient norms and weights as full
    recomputation keeping them, alone, beside optimizer offload, and under LoRA (whose frozen embedding's
    output needs no gradient)."""
    over = {**FULL, **{"zero2-offload": {"parallel.zero_stage": "2", "parallel.offload": "optimizer"},
                       "lora": {"lora.rank": "4", "lora.alpha": "8"}, "plain": {}}[case]}
    want = dist_fns.train_and_capture(0, 1, over)
    got = dist_fns.train_and_capture(0, 1, {**over, "parallel.offload_activations": "true"})
    for key in ("losses", "grad_norms"):
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=0)
    for name, value in want["masters"].items():
        torch.testing.assert_close(got["masters"][name], value, rtol=1e-6, atol=1e-7, msg=name)
    assert got["grad_norms"][0] > 0


def test_offloaded_activations_need_full_recomputation():
    from shardlm.config import ConfigError
    with pytest.raises(ConfigError, match="train.recompute = 'full'"):
        dist_fns.tiny_trainer(1, {**FULL, "train.recompute": "selective", "parallel.offload_activations": "true"})


@ON_GPU
def test_offloaded_activations_on_a_gpu_equal_keeping_them_and_take_less_memory():
    """On a GPU the inputs go down on a stream of their own into pinned memory and come back when backward
    reaches each block: the same bf16 run as keeping them, at a peak lower by at least half of what the kept
    inputs take (a deep, narrow model whose kept inputs are most of its activations). Peaks are counted from
    what each run starts with, so what an earlier run leaves cached (cuBLAS workspaces) does not count."""
    layers, seq, micro_batch, hidden = 32, 256, 8, 128
    shape = {"model.num_layers": str(layers), "train.seq_len": str(seq), "model.max_seq_len": str(seq),
             "train.device": "cuda", "train.precision": "bf16", "train.micro_batch_size": str(micro_batch),
             "train.global_batch_size": str(2 * micro_batch), "model.hidden_size": str(hidden), **SGD_KEYS}
    runs = {}
    for offload in ("false", "true"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        runs[offload] = dist_fns.train_and_capture(0, 1, {**FULL, **shape, "parallel.offload_activations": offload})
        runs[offload]["peak"] = torch.cuda.max_memory_allocated() - base
    got, want = runs["true"], runs["false"]
    for key in ("losses", "grad_norms"):
        torch.testing.assert_close(got[key], want[key], rtol=1e-3, atol=1e-5)
    kept = (layers - 1) * micro_batch * seq * hidden * 2
    assert got["peak"] < want["peak"] - kept // 2, (got["peak"], want["peak"], kept)


@ON_GPU
@pytest.mark.parametrize("layout, bound", [
    ({"parallel.zero_stage": "3", "parallel.offload": "params"}, 0.25),
    ({"parallel.zero_stage": "2", "parallel.offload": "optimizer"}, 1.5),
    ({"lora.rank": "4", "lora.quantize": "nf4"}, 0.5)], ids=["zero3-params", "zero2-optimizer", "qlora"])
def test_the_model_is_built_straight_into_the_engines_buffers_on_a_gpu(layout, bound):
    """The engine writes the initial weights straight into its buffers: with ZeRO-3 and parameter offload one
    unit at a time, each sharded and freed before the next, so the GPU's peak while the trainer is built does
    not grow with depth; with ZeRO-2 and the optimizer offloaded it grows by the added 16-bit weights once;
    under QLoRA by their 4-bit form (each block quantised as soon as it is filled). Building the whole model
    first would add them twice (ZeRO-2) or once (ZeRO-3, QLoRA)."""
    built = {}
    for layers in (8, 32):
        # persist_threshold 0: ZeRO-3 would keep all of this narrow model's matrices whole
        shape = {"model.num_layers": str(layers), "model.hidden_size": "256", "train.device": "cuda",
                 "train.precision": "bf16", "parallel.persist_threshold": "0", **layout}
        # The trainers built before (this loop's, an earlier test's) hold memory until their cycles are
        # collected: freed during this build, it would hide the build's own allocations from the peak.
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        trainer = dist_fns.tiny_trainer(1, {**FULL, **shape})
        built[layers] = (torch.cuda.max_memory_allocated() - base, 2 * sum(p.numel() for p in trainer.model.parameters()))
        del trainer
    grew, added = built[32][0] - built[8][0], built[32][1] - built[8][1]
    assert grew < bound * added, built


@ON_GPU
def test_large_pinned_buffers_are_locked_at_their_exact_size():
    """Host buffers from EXACT_PIN_BYTES on are page-locked in place (torch's pinned allocator would round a
    52 GB buffer up to 64 GiB): pinned, of their exact size, copied to and from the GPU asynchronously and
    exactly; a view keeps the lock after the tensor it came from is gone, and buffers come and go."""
    from shardlm.runtime.device import EXACT_PIN_BYTES, host_empty
    n = EXACT_PIN_BYTES // 4 + 123
    for _ in range(2):
        host = host_empty(n, torch.float32, pin=True)
        assert host.is_pinned() and host.numel() == n and host.untyped_storage().nbytes() == 4 * n
        view = host[1:]
        del host
        src = torch.arange(n - 1, dtype=torch.float32, device="cuda")
        view.copy_(src, non_blocking=True)
        back = view.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert view.is_pinned() and torch.equal(back, src)
        del view
    assert not host_empty(100, torch.float32, pin=False).is_pinned()


def test_the_offload_benchmark_runs_on_the_cpu(tmp_path):
    """bench/offload.py's smoke run (tiny preset, CPU): each system in its own process, a row each in the
    table with the build's and the host's peaks (GPU figures are the device's; this keeps the script alive)."""
    script = Path(__file__).resolve().parents[1] / "bench" / "offload.py"
    systems = ["shardlm-zero2-offload", "shardlm-zero3-offload-params"]
    proc = subprocess.run([sys.executable, str(script), "--device", "cpu", "--preset", "tiny", "--seq", "64",
                           "--micro-batch", "1", "--microbatches", "2", "--warm", "0", "--steps", "1", "--compile", "0",
                           "--record", str(tmp_path / "rows.jsonl"), "--systems", *systems],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    header = next(line for line in proc.stdout.splitlines() if line.startswith("system"))
    assert "build GiB" in header and "host GiB" in header, header
    for system in systems:
        assert any(line.startswith(system + " ") for line in proc.stdout.splitlines()), proc.stdout
    assert not (tmp_path / "rows.jsonl").exists()  # a CPU smoke run is not a measurement


def test_two_runs_of_one_pid_share_an_offload_dir(tmp_path, monkeypatch):
    """Runs in two containers on one host's disk can have the same pid: the other run's file of the same
    name, made while this one's was being reserved, must neither clobber it nor refuse it."""
    from shardlm.parallel.offload_disk import MappedFiles
    reserve, theirs = os.posix_fallocate, []

    def other_run_meanwhile(fd, offset, size):
        reserve(fd, offset, size)
        monkeypatch.setattr(os, "posix_fallocate", reserve)  # the other run's own reservation as usual
        theirs.append(MappedFiles(tmp_path).tensor("master", 1024, torch.float32).fill_(2.0))
    monkeypatch.setattr(os, "posix_fallocate", other_run_meanwhile)
    files = MappedFiles(tmp_path)
    mine = files.tensor("master", 1024, torch.float32).fill_(1.0)
    assert bool((mine == 1.0).all()) and bool((theirs[0] == 2.0).all())
    # the step streams the state through the descriptor: it must be the mapping's file, not the other run's
    assert os.pread(files.fds["master"], 4096, 0) == mine.numpy().tobytes()
    assert list(tmp_path.iterdir()) == []  # nothing left behind
