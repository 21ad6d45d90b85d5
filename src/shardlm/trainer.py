"""The training loop: gradient accumulation, mixed precision, clipping, schedule, eval, logging, checkpoints.

One step consumes global_batch_size samples: each data-parallel rank runs global / (micro x dp)
micro-batches of micro_batch_size, scaling each micro-batch loss by 1 / accumulation so the summed
gradient is the gradient of the mean loss over the global batch (every sample has the same number of
tokens, so the mean of micro-batch means is the global mean). Everything a step depends on is a function of
the step number and the checkpointed state, which is what makes a resumed run reproduce the uninterrupted
one exactly."""
from __future__ import annotations

import gc
import os
import signal
import sys
import time
import weakref
from collections import deque
from contextlib import closing, nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from . import compat, resuming, rundir
from .config import IGNORE, Config, ConfigError
from .config.expert_checks import moe_notes
from .data.instruct import completion_stop_ids
from .data.loader import data_bytes, open_train_data
from .divergence import TrainingError, numerical_failures, step_numbers
from .generation_config import own_generation_config
from .inference import generate_text
from .inference.reference import prompt_room
from .memory_check import check_memory
from .mesh import DeviceMesh, init_distributed
from .metrics import Eta, MetricsLogger, format_line, memory_gib, peak_flops
from .optim import lr_at, warmup_note
from .parallel.moe_balance import MoEBalance
from .parallel.parallelize import parallelize
from .plan import Layout
from .plan.frozen import frozen_flops_per_token
from .precision import make_loss_scaler
from .run_checkpoint import CheckpointSaver
from .runtime.console import Console
from .runtime.device import training_device
from .runtime.gc_schedule import ScheduledGC
from .runtime.preemption import LazyHostGroup, StopSignals, resume_command, signal_name
from .runtime.said import said_check
from .runtime.watchdog import Watchdog
from .tokenizer import load_tokenizer


RECORDS_KEPT = 1000


class Trainer:
    def __init__(self, cfg: Config, out_dir: str | Path | None = None, resume: str | Path | None = None,
                 mesh: DeviceMesh | None = None, log=print, overwrite: bool = False):
        self.cfg, self.overwrite = cfg, overwrite
        self.console = Console(log)  # a console that goes away stops the run as a signal does, saved
        self.log = self.console
        self.owns_process_group = mesh is None and not dist.is_initialized()
        where = {"--out": out_dir, "--resume": resume}  # rank 0 saves to its --out, each rank its shards to its own
        self.mesh = mesh if mesh is not None else init_distributed(
            cfg, {k: os.path.abspath(v) for k, v in where.items() if v is not None})
        self.owns_process_group &= dist.is_initialized()
        self.out = Path(out_dir) if out_dir is not None else None
        t = cfg.train
        self.device = training_device(t, cfg.parallel, self.mesh)  # before --out is touched
        # On GPUs a stalled peer must end this rank within parallel.timeout_s once training runs (see
        # Watchdog: NCCL's own timeout would let a step go on with aborted collectives' data); gloo raises
        # by itself. Setup is left to NCCL's timeout: loading a large checkpoint may take long on every rank.
        distributed_gpu = self.device.type == "cuda" and self.mesh.world > 1
        self.watchdog = Watchdog(cfg.parallel.timeout_s) if distributed_gpu else None
        torch.manual_seed(t.seed)
        self.run_lock = None
        if self.out is not None:
            self.run_lock, restart = rundir.claim(self.out, self.mesh.is_main, self.mesh.from_main, log)
            if self.run_lock is not None:  # a Trainer never closed lets go of the directory when collected
                weakref.finalize(self, self.run_lock.release)
            resume = self.out if restart else resume  # torchrun's restart continues its job's saves
        try:
            self._setup(cfg, resume, overwrite, log)
        except BaseException:
            if self.run_lock is not None:  # a refused run leaves no trace: a directory it made goes again
                self.run_lock.release(undo=True)
            raise

    def _setup(self, cfg: Config, resume, overwrite: bool, log) -> None:
        t = cfg.train
        sharded = t.checkpoint_format == "sharded" and not cfg.parallel.delayed_update  # every rank writes
        if self.out is not None and self.mesh.world > 1 and sharded:
            rundir.refuse_unshared(self.out, self.mesh.rank, self.mesh.from_main, self._any_rank)
        if self.out is not None:
            failed = rundir.prepare(self.out, Path(resume) if resume is not None else None, overwrite,
                                    self.mesh.is_main, log)
            if self._any_rank(failed is not None):
                raise ConfigError(failed or f"rank 0 could not prepare --out {self.out} (its message says why)")

        self.data_dir = data_dir = compat.train_data_dir(self.cfg)
        self.tokenizer = load_tokenizer(data_dir)
        if cfg.model.vocab_size == 0:  # the data's tokenizer says how many token ids there are
            cfg.model.vocab_size = self.tokenizer.vocab_size
        if t.sample_tokens and self.mesh.pp == 1:  # the sample runs after the last save: refused before training
            prompt_room(self.tokenizer, t.sample_prompt, cfg.model.max_seq_len, "train.sample_prompt")
        check_memory(cfg, self.device, self._any_rank)
        size = sum(data_bytes(d) for d in (data_dir, cfg.data.eval_path) if d)
        checking = f"checking the CRC32 of {size / 1e9:,.1f} GB of token shards on each rank before training"
        with said_check(log if self.mesh.is_main else None, checking, size):
            self.data = open_train_data(data_dir, cfg.data.eval_path or None, cfg.data.eval_windows, t.seq_len,
                                        cfg.model.vocab_size, t.seed, t.global_batch_size, t.micro_batch_size,
                                        self.mesh.dp, self.mesh.dp_rank)
        compat.check_trainable(data_dir, self.data.train.shards.index)
        # Each rank reads its own files (a node's local copy): other tokens on one rank trained on silently.
        # An index lists its shards' sizes and CRC32s, which the loader checked against the files.
        compat.check_same_data(self.data, data_dir, cfg.data.eval_path)
        notes = [*compat.data_notes(t, data_dir, self.data, resumed=resume is not None), *moe_notes(cfg)]
        for note in notes if self.mesh.is_main else ():
            if note:
                log(note)
        if resume is None:  # a resume checks the checkpoint's tokenizer instead (_resume)
            compat.check_tokenizer(cfg, data_dir, self.data.train.shards.index, self.tokenizer, None,
                                   log if self.mesh.is_main else lambda *a: None)
        self.untrained_steps = 0  # steps whose batch held no trained token, skipped (data.skip_untrained)
        checkpoint, same_dir = resuming.choose(self, resume) if resume is not None else (None, False)

        self.scaler = make_loss_scaler(t.precision)
        self.parallel = parallelize(cfg, self.mesh, self.device, self.scaler, resuming=resume is not None)
        self.model, self.engine = self.parallel.model, self.parallel.engine
        self.model.doc_eos = self.data.packed_eos
        if self.model.doc_eos is not None and t.attention == "flash":
            raise ConfigError("train.attention = 'flash' takes no attention mask, which packed instruction examples "
                              "need to stay apart (use auto, efficient or math, or prepare the data with --pad-to)")
        ring = cfg.parallel.cp > 1 and cfg.parallel.cp_comm == "p2p"
        if self.model.doc_eos is not None and t.attention == "auto" and self.device.type == "cuda" and not ring:
            # A mask rules out flash, and with grouped-query attention SDPA's auto choice falls to the math
            # kernel (scores in memory): the memory-efficient kernel, K/V repeated per head, takes the mask. Ring
            # attention picks each block's kernel itself (cuDNN's for masked bf16 blocks: 8x this one's speed).
            self.model.set_attention("efficient")
        self.forward_backward = self.parallel.forward_backward
        self.moe = MoEBalance(self.model, self.mesh, cfg.model, self.device)  # router bias, per-layer load statistics
        self.step = 0
        self.saved_step = 0  # the step of the last checkpoint written or resumed: a stop that would lose steps saves
        self.stopped_by, self.computed = 0, False  # the signal that stopped run() early; a step's forward run
        # The stop checks' and asynchronous saves' gloo group (runtime/preemption.py); destroyed with the others.
        self.host_group = LazyHostGroup(timedelta(seconds=cfg.parallel.timeout_s))
        # The weights' source's generation_config.json (a chat model's end of turn), kept in every checkpoint
        generation = own_generation_config(checkpoint) or own_generation_config(t.init_from)
        self.saver = CheckpointSaver(self.parallel, cfg, self.out, self.tokenizer, self._any_rank, self.host_group,
                                     self.log if self.mesh.is_main else lambda *a: None, generation)
        self.stop_ids = completion_stop_ids(self.tokenizer, generation)  # where the sample ends, as generate's would
        self.resumed_from = None
        if checkpoint is not None:
            resuming.load(self, checkpoint)
        if (note := warmup_note(t)) and self.mesh.is_main and self.step < t.steps:  # no schedule runs: no note
            log(note)
        # What is computed: frozen weights (a LoRA base, train.freeze's) have no weight gradient.
        self.flops_per_token = cfg.lora.flops_per_token(cfg.model, t.seq_len) if cfg.lora.rank else \
            cfg.model.flops_per_token(t.seq_len) - frozen_flops_per_token(cfg.model, Layout.from_config(cfg))
        self.peak = peak_flops(self.device, t.peak_tflops)
        if self.out is not None and self.mesh.is_main and (overwrite or same_dir):
            (rundir.overwrite_run if overwrite else rundir.drop_damaged_after)(self.out, checkpoint, log)
        self.metrics = MetricsLogger(self.out, self.mesh.is_main, t.tensorboard,
                                     resume_step=self.step if same_dir else None, warn=self.log)
        if self.out is not None and self.mesh.is_main and self.step < t.steps:  # else no run: none in --out
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "config.toml").write_text(cfg.to_toml())

    # ---- setup ------------------------------------------------------------------------------------
    def _any_rank(self, failed: bool) -> bool:
        return self.mesh.any_rank(failed, self.device)

    # ---- the loop ---------------------------------------------------------------------------------
    def _guard(self, label: str):
        """A host section that waits on peer ranks, guarded by the watchdog where there is one (it yields `alive`)."""
        return self.watchdog.guard(label) if self.watchdog is not None else nullcontext(lambda: None)

    def train_step(self) -> torch.Tensor | None:
        """One optimizer step; returns the mean loss over the global batch as a device tensor (no sync), None
        for a step skipped as untrained."""
        accum = self.cfg.grad_accum_steps
        whole = [self.data.micro_batch_at(self.step, m) for m in range(accum)]
        cpu = [self.slice_of(*batch) for batch in whole]
        trained, weights, aux_weights = self.data.trained_tokens(self.step), None, None
        if trained == 0:  # alike on every rank: the count is the global batch's
            if not self.cfg.data.skip_untrained:
                raise TrainingError(compat.untrained_step(self.step + 1, self.data_dir, self._save_unsaved()))
            self.untrained_steps += 1
            return None
        if trained is not None:
            # The step's loss is the mean over the global batch's trained targets: a micro-batch's mean
            # weighs by its share of them (times dp x cp, which the gradients' mean over the replicas divides
            # out).
            replicas = self.mesh.size("dp+cp")
            weights = [int((y != IGNORE).sum()) * replicas / max(trained, 1) for _, y in cpu]
            if self.mesh.cp > 1:  # MoE auxiliary losses span whole sequences: the mean of their slices' weights
                aux_weights = [int((y != IGNORE).sum()) * replicas / self.mesh.cp / max(trained, 1) for _, y in whole]
        batches = ((x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)) for x, y in cpu)
        # The step's host section waits on peers too (fp16's overflow check, MoE's exact dispatch counts,
        # offload's scale): guarded, or a peer lost mid-step left this rank to NCCL's longer timeout. Not this
        # process's first step that computes, whose compilation may outlast parallel.timeout_s on every rank.
        with self._guard(f"training step {self.step + 1}") if self.computed else nullcontext():
            total = self.forward_backward(batches, accum, self.device, weights, aux_weights)
            skipped = self.scaler.skipped_steps
            untouched = self.resumed_from is None and self.step == skipped + self.untrained_steps  # no update yet
            with numerical_failures(total, self.step, untouched, self.cfg, self.out):
                self.engine.optimizer_step(lr_at(self.step, self.cfg.train), self.step + 1)
        self.computed = True
        self.moe.after_step(self.scaler.skipped_steps != skipped)  # DeepSeek-V3's bias update (global loads)
        if self.watchdog is not None and self.device.type == "cuda":  # the step's collectives, in time
            done = torch.cuda.Event()
            done.record()
            self.watchdog.watch(done, f"training step {self.step + 1}")
        return total

    def slice_of(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a batch of sequences: under context parallelism the slice of each that its
        model holds (parallel/context.py), else all of it."""
        return self.model.sequence.local(x), self.model.sequence.local(y)

    def global_mean(self, value: torch.Tensor) -> float:
        """The mean of a per-rank scalar over the replicas (dp x cp: each rank saw an equal share of the
        batch's tokens)."""
        replicas = self.mesh.size("dp+cp")
        if replicas > 1:
            value = value.clone()
            dist.all_reduce(value, group=self.mesh.group("dp+cp"))
            value /= replicas
        return value.item()

    @torch.no_grad()
    def evaluate(self) -> float | None:
        self.model.eval()
        # Every rank evaluates the same batches: ZeRO-3's parameter gathers are collectives.
        # Weighted by each batch's trained targets (all of them, but for instruction data's masks): the mean
        # over the held-out targets, not a mean of batches' means.
        batches = (self.slice_of(*batch) for batch in self.data.eval_batches(self.cfg.train.eval_batches))
        losses = [(self.parallel.eval_loss(x.to(self.device), y.to(self.device)), int((y != IGNORE).sum()))
                  for x, y in batches]
        self.model.train()
        total = torch.tensor([sum(loss * n for loss, n in losses), sum(n for _, n in losses)], dtype=torch.float64)
        if self.mesh.cp > 1:  # each rank scored its slice of the sequences
            total = total.to(self.device)
            dist.all_reduce(total, group=self.mesh.group("cp"))
        weighted, trained = total.tolist()
        return weighted / trained if trained else None

    def save(self, wait: bool = True) -> Path | None:
        """Save this step (`wait` False: in the background where train.checkpoint_async says so)."""
        if self.out is None:
            return None
        state = {"config": compat.located(self.cfg.to_dict()), "data": self.data.state(self.step),
                 "loss_scaler": self.scaler.state_dict(), "untrained_steps": self.untrained_steps,
                 "router_bias": self.moe.state()}
        with self._guard(f"saving step {self.step}") as alive:
            self._step_numbers()  # no checkpoint of weights after a gradient that was not finite
            path = self.saver.save(self.step, state, wait, alive)
        self.saved_step = self.step
        return path

    def _save_unsaved(self) -> str | None:
        """Before a stop that leaves the run where its data has a batch it cannot train (every rank alike): the
        steps trained since the last checkpoint saved, and the command that continues them. Packed instruction
        data can hold such a batch hundreds of steps in, where a run that saves only at its end lost them all."""
        if self.out is None:
            return None
        if self.step > self.saved_step:
            self.save()
        else:
            self.saver.finish()  # a periodic save of this very step may still be being written
        return resume_command(self.out, self.mesh.world) if self.step else None

    def _step_numbers(self) -> tuple[float, int]:
        return step_numbers(self.engine, self.step, self.cfg, self.resumed_from is None, self.out)

    def run(self) -> list[dict]:
        """Train to train.steps, or until a SIGTERM or SIGINT: then every rank stops after the same step
        and saves it (runtime/preemption.py), and `stopped_by` names the signal. Returns the last RECORDS_KEPT
        records logged (metrics.jsonl holds them all)."""
        with StopSignals(self.host_group()) as signals:
            return list(self._run(signals))

    def _run(self, signals: StopSignals) -> list[dict]:
        from tqdm import tqdm

        t = self.cfg.train
        # Bounded: a record holds each MoE layer's statistics, tens of KiB a line, on every rank for the whole run.
        records = deque(maxlen=RECORDS_KEPT)
        tokens_per_step = t.global_batch_size * t.seq_len
        bar = tqdm(total=t.steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                   disable=not self.mesh.is_main or not sys.stderr.isatty())
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        # Tokens of the steps run since the last record: a step skipped as untrained ran no forward (none counted).
        since, tokens_since, eta = time.perf_counter(), 0, Eta(t.steps, shown=bar.disable)
        losses_since, trained_since = None, 0  # the losses of the steps trained since the last record
        with closing(bar), ScheduledGC(t.gc_every) as collector:
            while self.step < t.steps:
                loss = self.train_step()
                self.step += 1
                tokens_since += tokens_per_step if loss is not None else 0
                if loss is not None:  # on the device: no sync a step
                    losses_since = loss.clone() if losses_since is None else losses_since + loss
                    trained_since += 1
                collector.step(self.step)
                bar.update(1)
                if self.console.lost:
                    signals.received = signals.received or signal.SIGPIPE
                with self._guard(f"the stop check of step {self.step}"):
                    self.stopped_by = signals.agreed()
                do_eval = t.eval_every > 0 and (self.step % t.eval_every == 0 or self.step == t.steps)
                first = not records  # the first step this process runs (a resumed one too): alive within seconds
                if first or self.step % t.log_every == 0 or self.step == t.steps or do_eval or self.stopped_by:
                    with self._guard(f"the metrics of step {self.step}"):
                        norm, skipped = self._step_numbers() if loss is not None else \
                            (None, self.scaler.skipped_steps)  # an untrained step skipped: no update to ask about
                        # The mean over the steps since the last record (HF Trainer's, Megatron's): spikes show.
                        loss = self.global_mean(losses_since / trained_since) if trained_since else None
                    elapsed = time.perf_counter() - since
                    tok_s = tokens_since / elapsed
                    rec = {"step": self.step, "loss": loss, "lr": lr_at(self.step - 1, t), "grad_norm": norm,
                           "tokens_per_s": tok_s,
                           "mfu": tok_s * self.flops_per_token / (self.peak * self.mesh.world) if self.peak else None,
                           "mem_gib": memory_gib(self.device), "skipped_steps": skipped,
                           **({"loss_scale": self.scaler.scale} if t.precision == "fp16" else {}),
                           **({"untrained_steps": self.untrained_steps} if self.cfg.data.skip_untrained else {})}
                    rec.update(self.engine.metrics())
                    rec.update(self.moe.stats())  # per MoE layer, over the global batch
                    if do_eval:
                        with self._guard(f"the evaluation at step {self.step}"):
                            rec["eval_loss"] = self.evaluate()
                    records.append(rec)
                    self.metrics.log(rec)
                    if self.mesh.is_main:
                        line = format_line(rec) + (f" | eval {rec['eval_loss']:.4f}" if rec.get("eval_loss") else "") \
                            + eta(self.step)
                        with bar.external_write_mode() if not bar.disable else nullcontext():
                            self.log(line)
                    since, tokens_since, losses_since, trained_since = time.perf_counter(), 0, None, 0
                if self.stopped_by:
                    break
                with self._guard(f"the save before step {self.step}") as alive:
                    self.saver.poll(alive)
                if t.save_every and self.step % t.save_every == 0 and self.step < t.steps:
                    self.save(wait=False)
        if self.step > 0 and (self.resumed_from is None or records):
            path = self.save()
            if path:
                self.log(f"saved {path}")
        self.engine.wait_for_weights()  # after the save: landing a delayed update first moved the resumed run
        self.metrics.close()
        if self.stopped_by:
            complete = self.step >= t.steps  # the signal came during the last step: nothing is left to continue
            if self.mesh.is_main and complete:
                skipped = "; the end-of-run sample was skipped" if t.sample_tokens else ""
                self.log(f"{signal_name(self.stopped_by)} received during the last step: the run is complete "
                         f"({self.step} of {t.steps} steps){skipped}")
            elif self.mesh.is_main:
                how = f"; to continue: {resume_command(self.out, self.mesh.world)}" if self.out is not None else ""
                self.log(f"stopped by {signal_name(self.stopped_by)} after step {self.step} of {t.steps}{how}")
            self.stopped_by = 0 if complete else self.stopped_by  # the exit status: a run stopped early only
            return records
        if t.sample_tokens and self.mesh.pp > 1:
            if self.mesh.is_main:
                self.log("no sample under pipeline parallelism: `shardlm export` the run and `shardlm generate`")
        elif t.sample_tokens:
            # Every rank decodes the same tokens (ZeRO-3 gathers are collectives; generation's KV cache runs
            # the whole sequence on each rank, without context parallelism's exchanges); rank 0 prints them.
            room = prompt_room(self.tokenizer, t.sample_prompt, self.cfg.model.max_seq_len, "train.sample_prompt")
            with self._guard("the sample"):
                text = generate_text(self.model, self.tokenizer, t.sample_prompt, min(t.sample_tokens, room),
                                     temperature=0.8, top_k=40, seed=t.seed, stop_ids=self.stop_ids)
            if self.mesh.is_main:
                self.log("sample:\n" + t.sample_prompt + text)
        return records

    def close(self) -> None:
        self.engine.close()
        # A gloo group left to interpreter shutdown can abort the process (its worker threads outlive
        # Python, pytorch#190489), and NCCL warns; tear down what this trainer set up, on success only:
        # after a failure the launcher's kill is safer than waiting on peers. The barrier first: a rank
        # done early (rank 0 still writes the checkpoint and the sample) could tear its gloo group down
        # while the peer's last messages are in flight, and abort at exit.
        if self.owns_process_group and dist.is_initialized():
            with self._guard("the final barrier"):  # a peer that stalls at the end must not hang this rank
                dist.barrier()
            # destroy_process_group drops only torch's own references to the groups: the engine's (its
            # optimizer's, ZeRO-3's hooks on the model) would keep them, and their gloo threads, for the
            # garbage collector at interpreter shutdown. Release them now, while Python still runs.
            self.engine = self.model = self.forward_backward = self.parallel = self.saver = None
            self.mesh.release_groups()
            self.host_group = None
            gc.collect()
            dist.destroy_process_group()
            self.owns_process_group = False
        if self.watchdog is not None:
            self.watchdog.close()
            self.watchdog = None
        if self.run_lock is not None:
            self.run_lock.release()
