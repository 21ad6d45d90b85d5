"""A run's checkpoints, saved by every rank: sharded (each rank writes the state it owns, in parallel, and the
main rank commits the manifest and state.json once all are written: parallel/sharded_state.py), or
gathered onto the main rank as full tensors (`train.checkpoint_format = "full"`, and ZeRO-Offload's delayed
update, whose second copy of the weights the pieces do not describe). Either way a checkpoint is atomic: a
crash before the commit leaves only a temporary directory, and every earlier checkpoint as it was.

With `train.checkpoint_async` a sharded save copies each rank's pieces to host memory (page-locked on a GPU
machine: the one pass over the state the step waits for) and a thread writes them while training goes on,
as DCP's `async_save` and Megatron's asynchronous checkpointing do. The ranks commit it at the first step
boundary where all of them are done (`poll`, one small host-side all-reduce a step while a save is in
flight); the next save, and the run's end, wait for it.
"""
from __future__ import annotations

import json
from functools import partial
import shutil
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .checkpoint import CKPT_DIR, MANIFEST, CheckpointError, fsync_files
from .checkpoint_write import begin_checkpoint, commit_checkpoint, failed_save, save_checkpoint, write_tensors
from .config import RunError
from .divergence import TrainingError, refuse_unusable_weights
from .parallel.sharded_state import pieces, snapshot, staged_bytes, write_shards
from .rng_state import rng_layout, rng_state
from .runtime.device import host_empty
from .runtime.first_rank import Moved, every_rank_done, first_rank_result


class CheckpointSaver:
    """`save(step, state)` for a run (`state`: state.json's contents, the main rank's counts); `any_rank(failed)`:
    whether any rank failed, so that all stop together; `host_group()`: a gloo group over the world (None
    with one process), for the asynchronous saves' polls; `log` says how long each save took."""

    def __init__(self, parallel, cfg, out: Path, tokenizer, any_rank, host_group, log,
                 generation_config: dict | None = None):
        self.parallel, self.cfg, self.out, self.tokenizer = parallel, cfg, out, tokenizer
        self.generation_config = generation_config  # the weights' source's, kept in every checkpoint
        self.any_rank, self.host_group, self.log = any_rank, host_group, log
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.pending: dict | None = None  # the asynchronous save in flight
        self.pin = torch.cuda.is_available()
        self.staging: torch.Tensor | None = None  # its host copy of this rank's pieces, kept for the next
        if out is not None and (why := grace_warning(cfg)):
            log(why)
        t = cfg.train
        sharded = t.checkpoint_format == "sharded" and not cfg.parallel.delayed_update
        if out is not None and t.checkpoint_async and sharded:
            # Made now rather than at the first save: page-locking tens of GB would stall the steps it overlaps.
            start = time.perf_counter()
            self._staging()
            log(f"asynchronous saves: {self.staging.numel() / 2**30:.2f} GiB of host memory for this rank's "
                f"copy, made in {time.perf_counter() - start:.1f} s")

    def _pieces(self):
        buffer = self.cfg.train.checkpoint_buffer_mb * 2**20
        return pieces(self.parallel.engine, self.parallel.model, self.parallel.mesh, buffer)

    def _staging(self) -> torch.Tensor:
        """The host buffer an asynchronous save copies this rank's pieces into (their number is the run's).
        Counted, and later copied, a piece at a time: a QLoRA base's pieces are its NF4 weights dequantized as
        they come, which held all at once would take the 16-bit model's memory on the GPU."""
        if self.staging is None:
            need = sum(staged_bytes(values) for _, values in self._pieces())
            self.staging = host_empty(max(need, 1), torch.uint8, self.pin)
        return self.staging

    def save(self, step: int, state: dict, wait: bool = False, alive=lambda: None) -> Path | None:
        """Save step `step`; returns the checkpoint's path on the main rank once it is committed (an
        asynchronous save: None now, its path from `poll` or `finish`). `wait`: synchronously. `alive()` is
        called while the ranks wait for each other's writes and they make progress: the watchdog's sign that
        a long save is no stall (one that stops making progress for parallel.timeout_s is ended, with a message)."""
        self.finish(alive)
        t, start = self.cfg.train, time.perf_counter()
        if t.checkpoint_format == "full" or self.cfg.parallel.delayed_update:
            path = self._save_gathered(step, state, alive)
        else:
            tmp = self._begin(step)
            if t.checkpoint_async and not wait:
                staging = self._staging()
                self._start(step, state, tmp, snapshot(self._pieces(), self.pin, staging))
                self.log(f"step {step}: copied to host memory in {time.perf_counter() - start:.2f} s, being written")
                return None
            # Written by a thread as an asynchronous save is (from the state itself, not a copy), so that the
            # main thread can answer ranks that finished their writes sooner: they wait as long as it writes.
            self._start(step, state, tmp, self._pieces())
            path = self._complete(alive)
        self.log(f"step {step}: saved in {time.perf_counter() - start:.2f} s")
        return path

    def poll(self, alive=lambda: None) -> Path | None:
        """Commit the save in flight if every rank has written its part (a host-side collective while one is)."""
        if self.pending is None:
            return None
        busy = torch.tensor([float(self.pending["thread"].is_alive())])
        if self.host_group() is not None:
            dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=self.host_group())
        return None if busy.item() else self.finish(alive)

    def finish(self, alive=lambda: None) -> Path | None:
        """Wait for the save in flight and commit it."""
        if self.pending is None:
            return None
        step, start = self.pending["step"], self.pending["start"]
        path = self._complete(alive)
        self.log(f"step {step}: saved in {time.perf_counter() - start:.2f} s, in the background")
        return path

    def _complete(self, alive) -> Path | None:
        """Wait for every rank's writes of the save in flight, then commit it."""
        pending, self.pending = self.pending, None
        every_rank_done(pending["thread"], pending["moved"], self.host_group(), self.cfg.parallel.timeout_s,
                        f"writing step {pending['step']}", alive)
        if "interrupted" in pending:
            raise pending["interrupted"]
        return self._commit(pending["step"], pending["state"], pending["tmp"], pending["written"], pending["rng"],
                            alive)

    # ---- the parts of a save ----------------------------------------------------------------------
    def _on_main(self, mine):
        """Every rank's `mine` in rank order on the main rank (a collective), None on the others."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return [mine]
        everyone = [None] * dist.get_world_size() if self.parallel.mesh.is_main else None
        dist.gather_object(mine, everyone, dst=0)
        return everyone

    def _save_gathered(self, step: int, state: dict, alive) -> Path | None:
        masters, optim = self.parallel.gather_full_state()  # a collective when the state is sharded
        everyone = self._on_main(rng_state())

        def write(moved):
            refuse_unusable_weights(masters, self.cfg.train.precision, step, self.out)
            return save_checkpoint(self.out, step, masters, optim, state, self.tokenizer,
                                   keep=self.cfg.train.keep_checkpoints, generation_config=self.generation_config,
                                   rng=self._every_rank(everyone), moved=moved)
        return self._by_main(write, step, alive)

    def _by_main(self, work, step: int, alive) -> Path | None:
        """work(moved) (the main rank's writes) on the main rank, its result there; the others wait as long as
        the writes make progress (runtime/first_rank.py), and stop with it where it could not save."""
        try:
            path = first_rank_result(work, stall_s=self.cfg.parallel.timeout_s,
                                     what=f"rank 0's writes of step {step}", on_tick=alive)
        except RunError:
            if self.parallel.mesh.is_main:
                raise
            raise TrainingError(f"rank 0 could not save step {step} (its message says why)") from None
        return path if self.parallel.mesh.is_main else None

    def _begin(self, step: int) -> Path:
        """The temporary directory every rank writes into, made by the main rank."""
        error = None
        if self.parallel.mesh.is_main:
            try:
                begin_checkpoint(self.out, step)
            except CheckpointError as e:
                error = e
        self._together(error, f"rank 0 could not begin saving step {step} (its message says why)")
        self.parallel.engine.wait_for_weights()  # an update still in flight writes the masters
        return Path(self.out) / CKPT_DIR / f".tmp-step_{step:08d}"

    def _steps(self) -> int:
        """The optimizer's step count (AdamW's bias correction), taken with the state it goes with: an asynchronous
        save's writer reading it later recorded the updates made meanwhile."""
        return max([e.opt.steps_taken for e in self.parallel.engine.group_engines() if e.opt is not None], default=0)

    def _write(self, step: int, tmp: Path, parts, steps: int, moved) -> dict:
        """This rank's files: their records, the manifest entries, and what went wrong (None: nothing);
        `moved()` called as each tensor is written and each file flushed."""
        t = self.cfg.train
        usable = _usable(t.precision, step, self.out)
        mine = {"files": [], "pieces": [], "problem": None, "steps": steps}
        try:
            mine["files"], mine["pieces"], mine["problem"] = write_shards(
                parts, tmp, self.rank, t.checkpoint_buffer_mb * 2**20, partial(write_tensors, sync=False, moved=moved),
                fsync_files, usable, moved)
        except OSError as e:
            mine["problem"] = f"{e.strerror or e} (rank {self.rank})" if self.rank else (e.strerror or str(e))
        except Exception as e:  # in a save's thread nothing else would report it
            mine["problem"] = f"{type(e).__name__}: {e} (rank {self.rank})"
        return mine

    def _start(self, step: int, state: dict, tmp: Path, parts) -> None:
        """This rank's writes of `parts` begun in a thread: the save in flight."""
        pending = {"step": step, "state": state, "tmp": tmp, "rng": rng_state(), "start": time.perf_counter(),
                   "moved": Moved()}
        steps = self._steps()

        def write():
            try:
                pending["written"] = self._write(step, tmp, parts, steps, pending["moved"])
            except BaseException as e:  # not a failed write (_write says those): an interrupt, for the main thread
                pending["interrupted"] = e
        pending["thread"] = threading.Thread(target=write, name=f"save-step-{step}", daemon=True)
        pending["thread"].start()
        self.pending = pending

    def _commit(self, step: int, state: dict, tmp: Path, mine: dict, rng: dict, alive=None) -> Path | None:
        """Every rank's records to the main rank, which writes the manifest and commits the checkpoint."""
        everyone = self._on_main({**mine, "rng": rng})

        def commit(moved):
            try:
                problem = next((m["problem"] for m in everyone if m["problem"] is not None), None)
                if isinstance(problem, str):
                    raise failed_save(self.out, step, problem)
                if problem is not None:
                    raise problem
                manifest = {"optimizer_steps": max(m["steps"] for m in everyone),
                            "pieces": [p for m in everyone for p in m["pieces"]]}
                try:  # the disk filled by the pieces fails here: a save's message, and every rank stopping with it
                    (tmp / MANIFEST).write_text(json.dumps(manifest) + "\n")
                except OSError as e:
                    raise failed_save(self.out, step, e.strerror or str(e)) from None
                written = {name: record for m in everyone for name, record in m["files"]}
                return commit_checkpoint(self.out, step, tmp, state, written, self.tokenizer,
                                         keep=self.cfg.train.keep_checkpoints,
                                         rng=self._every_rank([m["rng"] for m in everyone]),
                                         generation_config=self.generation_config, moved=moved)
            except RunError:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        return self._by_main(commit, step, alive)

    def _every_rank(self, states: list) -> dict:
        """rng.pt: rank 0's state, and every rank's for a resume in the same layout. Pipeline stages of unequal
        layers draw unequal numbers for dropout: each given rank 0's, a resumed run left the uninterrupted one."""
        return {**states[0], "ranks": states, "layout": rng_layout(self.cfg.parallel)}

    def _together(self, error: Exception | None, elsewhere: str) -> None:
        if self.any_rank(error is not None):
            raise error or TrainingError(elsewhere)


def _usable(precision: str, step: int, out):
    """A check of one master piece: None, or the error that refuses saving it (not finite; beyond fp16)."""
    def check(name, value):
        try:
            refuse_unusable_weights({name: value}, precision, step, out)
        except TrainingError as e:
            return e
        return None
    return check


GRACE_S = 30  # what torchrun (and Slurm's default KillWait) leave a process between SIGTERM and SIGKILL


def grace_warning(cfg, disk_bw: float = 6e9, gpus_per_node: int = 8) -> str | None:
    """A warning where the planner's estimate of one save (its largest rank's part at that rank's share of a
    node's disk rate) would not fit in the grace period a preempted run gets to save its last step."""
    from .plan import Layout, save_bytes
    layout = Layout.from_config(cfg)
    _, per_rank = save_bytes(cfg.model, layout)
    seconds = per_rank / (disk_bw / min(gpus_per_node, layout.gpus))
    if seconds <= GRACE_S:
        return None
    return (f"warning: a checkpoint of this run takes about {seconds:.0f} s to write (its largest rank's part at a "
            f"share of {disk_bw / 1e9:g} GB/s), more than the {GRACE_S} s torchrun and Slurm leave after SIGTERM: a "
            "preempted run would lose the steps since its last save; save more often (train.save_every), or give "
            "the job a longer grace period")
