"""Saves that a misbehaving disk or a crash interrupts: each must end in one line naming the checkpoint's path
and keep the previous checkpoint whole, whichever file of the save the disk fails at."""
import os
import stat
from pathlib import Path

import pytest
import torch
from shardlm.checkpoint import complete_checkpoints, load_checkpoint

QUIET = ["--train.tensorboard", "false", "--train.log_every", "1"]
FULL = "/dev/full"  # every write to it fails with ENOSPC, as a full disk's does: the libraries' real errors


def _train(capsys, run, *args):
    from shardlm.cli import main
    status = main(["train", "tiny", *QUIET, "--train.steps", "4", "--train.save_every", "2", "--out", str(run),
                   *map(str, args)])
    return status, capsys.readouterr().err.strip().splitlines()


@pytest.mark.skipif(not (os.path.exists(FULL) and stat.S_ISCHR(os.stat(FULL).st_mode)), reason="needs /dev/full")
@pytest.mark.parametrize("fmt", ["sharded", "full"])
@pytest.mark.parametrize("fails", ["rng.pt", "tokenizer.json"])
def test_a_disk_that_fills_at_the_rng_state_or_tokenizer_fails_the_save_in_one_line(tmp_path, monkeypatch, capsys,
                                                                                    fails, fmt):
    """The tensors fit and the small files after them do not: torch.save raised RuntimeError ("basic_ios::clear:
    iostream error") and the tokenizers library a bare Exception, neither an OSError, so the save ended in a
    traceback naming no path, its temporary directory left behind."""
    import shardlm.checkpoint_write as checkpoint_write
    import shardlm.run_checkpoint as run_checkpoint
    real = checkpoint_write.begin_checkpoint

    def begin(run_dir, step, *args, **kwargs):  # the save of step 4 finds its disk full at `fails`
        tmp = real(run_dir, step, *args, **kwargs)
        if step == 4:
            (tmp / fails).symlink_to(FULL)
        return tmp
    monkeypatch.setattr(checkpoint_write, "begin_checkpoint", begin)
    monkeypatch.setattr(run_checkpoint, "begin_checkpoint", begin)
    run = tmp_path / "run"
    status, err = _train(capsys, run, "--train.checkpoint_format", fmt)
    assert status == 1 and err, err
    assert err[-1].startswith("shardlm train: error: saving step 4 to ") and "step_00000004" in err[-1], err[-6:]
    assert "No space left on device" in err[-1] and "step_00000002 is kept" in err[-1], err[-1]
    assert [p.name for p in complete_checkpoints(run)] == ["step_00000002"]
    load_checkpoint(run)
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp")]


def test_an_asynchronous_save_whose_writer_starts_late_records_the_steps_it_saved(tmp_path, monkeypatch):
    """The writer thread read the optimizer's step count when it ran, not when the save copied the state: a
    thread that started after the next update (a busy host, the GIL) recorded one step more than its moments
    hold, and the run resumed from it applied AdamW's bias correction of the wrong step, silently off the
    uninterrupted run's trajectory."""
    import threading
    import time

    import dist_fns
    import shardlm.run_checkpoint as run_checkpoint
    real = run_checkpoint._usable

    def late(*args, **kwargs):  # called first in the writer: there, it waits past the next training step
        if threading.current_thread() is not threading.main_thread():
            time.sleep(1.0)
        return real(*args, **kwargs)
    monkeypatch.setattr(run_checkpoint, "_usable", late)
    over = {"train.steps": "6", "train.save_every": "2", "train.keep_checkpoints": "5",
            "train.checkpoint_async": "true"}
    full = dist_fns.train_and_capture(0, 1, over, str(tmp_path / "a"))
    monkeypatch.setattr(run_checkpoint, "_usable", real)
    ckpt = tmp_path / "a" / "checkpoints" / "step_00000004"
    optimizer = load_checkpoint(ckpt)["optimizer"]
    assert {optimizer[k].item() for k in optimizer if k.endswith("::step")} == {4.0}
    resumed = dist_fns.train_and_capture(0, 1, over, str(tmp_path / "b"), str(ckpt))
    assert resumed["losses"] == pytest.approx(full["losses"][4:], rel=1e-6)


@pytest.mark.skipif(not (os.path.exists(FULL) and stat.S_ISCHR(os.stat(FULL).st_mode)), reason="needs /dev/full")
def test_a_full_disk_at_a_save_says_how_much_to_free_and_where(tmp_path, monkeypatch, capsys):
    """"No space left on device; step_2 is kept" left the user to guess how much to free: a save writes a whole
    checkpoint beside the kept ones before rotating the oldest out, so it needs a checkpoint's size free."""
    import shardlm.checkpoint_write as checkpoint_write
    import shardlm.run_checkpoint as run_checkpoint
    real = checkpoint_write.begin_checkpoint

    def begin(run_dir, step, *args, **kwargs):
        tmp = real(run_dir, step, *args, **kwargs)
        if step == 4:
            (tmp / "rank00000-0000.safetensors").symlink_to(FULL)
        return tmp
    monkeypatch.setattr(run_checkpoint, "begin_checkpoint", begin)
    run = tmp_path / "run"
    status, err = _train(capsys, run)
    kept = run / "checkpoints" / "step_00000002"
    size = sum(p.stat().st_size for p in kept.iterdir())
    assert status == 1 and "No space left on device" in err[-1], err[-6:]
    assert f"free at least {size / 2**20:.1f} MiB (the size of step_00000002) on the filesystem of " \
           f"{run / 'checkpoints'}" in err[-1], err[-1]


def _tp_load_while_a_save_commits(rank, world, run, hidden):
    """load_pretrained of run directory `run` at --tp `world`, the run's next checkpoint (`hidden`, moved aside)
    committed just after rank 0 looked for the newest: the logits of a few tokens."""
    import time

    import shardlm.inference.load as load
    from shardlm.inference import load_pretrained
    from shardlm.mesh import build_mesh
    real = load.resolve_checkpoint

    def resolve(path, *args, **kwargs):
        if rank > 0:
            time.sleep(2.0)  # the ranks start apart: this one looks after the save below
        found = real(path, *args, **kwargs)
        if rank == 0 and Path(hidden).exists():
            Path(hidden).rename(Path(run) / "checkpoints" / "step_00000004")  # the training run commits it
        return found
    load.resolve_checkpoint = resolve
    model, _, _ = load_pretrained(run, tp_group=build_mesh(tp=world).group("tp"))
    with torch.no_grad():
        return model(torch.tensor([[1, 2, 3, 4, 5, 6]])).float()


def test_tensor_parallel_ranks_load_the_same_checkpoint_while_the_run_saves(tmp_path):
    """generate, eval and serve --tp N of a run still training: each rank took the newest checkpoint it found,
    and a save committed between two ranks' looks gave them different steps' slices, one model of two
    checkpoints' weights, without a word. The first rank picks; the others load its pick."""
    from shardlm.config import load_config
    from shardlm.inference import load_pretrained
    from shardlm.testing.distributed import run_distributed
    from shardlm.trainer import Trainer
    run = tmp_path / "run"
    cfg = load_config("tiny", {"train.steps": "4", "train.save_every": "2", "train.tensorboard": "false"})
    Trainer(cfg, out_dir=run, log=lambda *a: None).run()
    hidden = tmp_path / "next-save"
    (run / "checkpoints" / "step_00000004").rename(hidden)
    logits = run_distributed(_tp_load_while_a_save_commits, 2, str(run), str(hidden), timeout=180)
    one, _, _ = load_pretrained(run / "checkpoints" / "step_00000002")
    with torch.no_grad():
        want = one(torch.tensor([[1, 2, 3, 4, 5, 6]])).float()
    for got in logits:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_serve_replicas_serve_one_checkpoint_while_the_run_saves(tmp_path, monkeypatch):
    """serve --replicas N of a run still training loaded the run once per replica, each taking the newest
    checkpoint then: a save committed between two loads (each seconds to minutes of a large model) put two
    steps' weights behind one model name, a client's answers depending on the replica it reached."""
    import shardlm.inference as inference
    import shardlm.serve.command as command
    from shardlm.serve.command import cmd_serve
    from shardlm.config import load_config
    from shardlm.trainer import Trainer
    run = tmp_path / "run"
    cfg = load_config("tiny", {"train.steps": "4", "train.save_every": "2", "train.tensorboard": "false"})
    Trainer(cfg, out_dir=run, log=lambda *a: None).run()
    hidden = tmp_path / "next-save"
    (run / "checkpoints" / "step_00000004").rename(hidden)
    monkeypatch.setattr(command, "_replica_devices", lambda replicas, tp, device, asked="auto": [device] * replicas)
    real = inference.load_pretrained

    def load(*args, **kwargs):
        got = real(*args, **kwargs)
        if hidden.exists():  # the training run commits its next save while the server loads
            hidden.rename(run / "checkpoints" / "step_00000004")
        return got
    monkeypatch.setattr(inference, "load_pretrained", load)

    class Built(Exception):
        pass
    engines = []

    def build(engine, *args, **kwargs):
        engines.extend(engine if isinstance(engine, list) else [engine])
        raise Built
    monkeypatch.setattr(command, "build_server", build)
    with pytest.raises(Built):
        cmd_serve(["--model", str(run), "--replicas", "2", "--port", "0", "--device", "cpu"])
    first, second = (dict(e.model.named_parameters()) for e in engines)
    assert all(torch.equal(first[n], second[n]) for n in first)



@pytest.mark.timeout(180)
def test_a_batch_with_nothing_to_train_mid_run_saves_the_steps_before_it_and_says_how_to_go_on(tmp_path):
    """Packed instruction data can hold a global batch of prompt tokens only hundreds of steps in: the run stopped
    there (data.skip_untrained is off) without a checkpoint, every step since the last save lost. It saves them
    first and names the command that continues them past such batches."""
    from shardlm.config import load_config
    from shardlm.divergence import TrainingError
    from shardlm.trainer import Trainer

    def trainer(run, untrained, resume=False, **over):
        cfg = load_config("tiny", {"train.steps": "5", "train.tensorboard": "false", "train.sample_tokens": "0",
                                   **over})
        t = Trainer(cfg, out_dir=run, log=lambda *a: None, resume=run if resume else None)
        real = t.data.trained_tokens
        t.data.trained_tokens = lambda step: 0 if untrained(step) else real(step)
        return t

    run = tmp_path / "run"
    with pytest.raises(TrainingError) as stop:
        trainer(run, lambda step: step == 3).run()  # the fourth step's batch
    said = str(stop.value)
    assert said.startswith("step 4: no token of its batch is trained on"), said
    assert f"steps 1-3 are saved: continue them with `shardlm train --resume {run} --data.skip_untrained true`, " \
        "which skips such steps (counted in the metrics), or fix the data" in said, said
    assert [p.name for p in complete_checkpoints(run)] == ["step_00000003"]
    resumed = trainer(run, lambda step: step == 3, resume=True, **{"data.skip_untrained": "true"})
    records = resumed.run()
    resumed.close()
    assert resumed.step == 5 and records[-1]["untrained_steps"] == 1

    # a periodic save of the step before, still being written in the background: committed, and named
    with pytest.raises(TrainingError) as stop:
        trainer(tmp_path / "async", lambda step: step == 3, **{"train.save_every": "3",
                                                               "train.checkpoint_async": "true"}).run()
    assert "steps 1-3 are saved: continue them with" in str(stop.value), str(stop.value)
    assert [p.name for p in complete_checkpoints(tmp_path / "async")] == ["step_00000003"]

    with pytest.raises(TrainingError) as first:  # nothing trained before it: nothing to save
        trainer(tmp_path / "first", lambda step: True).run()
    assert "so its loss would read 0: fix the data, or set data.skip_untrained = true" in str(first.value)
    assert not complete_checkpoints(tmp_path / "first")
