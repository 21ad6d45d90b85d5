"""Sharded checkpoints: a save raises no rank's host memory by more than its staging buffer and a tenth of its
own shard, and a pipeline's save takes no longer than twice one process's (the full format gathers the whole
state onto rank 0: the contrast shows the memory measure can fail)."""
import os

import pytest
import torch

import dist_fns
from dp_cases import RTOL
from shardlm.testing.distributed import DistributedError, run_distributed

BUFFER_MB = 2
# About 5M parameters (60 MB of fp32 masters and moments): large beside the staging buffer and the noise.
MODEL = {"model.hidden_size": "256", "model.num_layers": "4", "model.ffn_hidden_size": "688",
         "model.vocab_size": "4096", "train.seq_len": "16", "train.checkpoint_buffer_mb": str(BUFFER_MB),
         "train.tensorboard": "false"}


@pytest.mark.parametrize("layout", [{"parallel.pp": "2", "parallel.dp": "1"},
                                    {"parallel.dp": "2", "parallel.zero_stage": "3"}], ids=["pp2", "dp2-zero3"])
def test_a_sharded_save_holds_no_more_than_its_buffer_and_a_tenth_of_its_shard(tmp_path, layout):
    results = run_distributed(dist_fns.save_memory, 2, {**MODEL, **layout}, str(tmp_path / "sharded"), timeout=240)
    for grown, shard, _ in results:
        assert grown <= BUFFER_MB * 2**20 + 0.1 * shard, (grown, shard)
    if "parallel.zero_stage" in layout:  # the measure sees a save that gathers (once: the slowest test)
        full = run_distributed(dist_fns.save_memory, 2, {**MODEL, **layout, "train.checkpoint_format": "full"},
                               str(tmp_path / "full"), timeout=240)
        grown, shard, _ = full[0]
        assert grown > BUFFER_MB * 2**20 + 0.1 * shard  # rank 0 gathers every rank's state
    else:  # a second of slack: the machine's other work, not the save's
        _, _, alone = dist_fns.save_memory(0, 1, MODEL, str(tmp_path / "one"))
        assert max(seconds for _, _, seconds in results) <= 2 * alone + 1.0


@pytest.mark.parametrize("world", [1, 2])
def test_an_asynchronous_save_resumes_on_the_same_trajectory(tmp_path, world):
    """Saves at steps 2 and 4 written by a thread while training goes on, committed when every rank is done:
    the run resumed from step 4 continues the uninterrupted run's losses."""
    over = {"train.steps": "6", "train.save_every": "2", "train.keep_checkpoints": "5", "train.checkpoint_async": "true",
            "parallel.zero_stage": "1" if world > 1 else "0"}
    if world == 1:
        full = [dist_fns.train_and_capture(0, 1, over, str(tmp_path / "a"))]
    else:
        full = run_distributed(dist_fns.train_and_capture, world, over, str(tmp_path / "a"), timeout=240)
    done = sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir())
    assert done == ["step_00000002", "step_00000004", "step_00000006"]
    ckpt = str(tmp_path / "a" / "checkpoints" / "step_00000004")
    resumed = dist_fns.train_and_capture(0, 1, {**over, "parallel.zero_stage": "0"}, str(tmp_path / "b"), ckpt)
    assert resumed["losses"] == pytest.approx(full[0]["losses"][4:], rel=1e-5)


def test_an_asynchronous_save_polled_by_code_that_steps_itself_commits_on_every_rank_at_once(tmp_path):
    """The ranks' writers finish at different steps (rank 0's slowed): the poll agrees over every rank before
    any of them commits, so none is left in a training step's collectives while another commits."""
    results = run_distributed(dist_fns.async_save_polled_while_stepping, 2, {"parallel.zero_stage": "3"},
                              str(tmp_path), timeout=120)
    (steps, done), (steps1, done1) = results
    assert steps == steps1 and 0 < steps < 200
    assert done == done1 == ["step_00000001"]


def test_the_planner_sizes_a_sharded_checkpoint_and_a_slow_one_is_warned_of_at_start():
    from shardlm.config import load_config
    from shardlm.plan import Layout, Workload, gpu, save_bytes
    from shardlm.plan import estimate as estimate_plan
    from shardlm.run_checkpoint import grace_warning
    cfg = load_config("llama2-7b", {"parallel.dp": "8", "parallel.zero_stage": "3"})
    whole, per_rank = save_bytes(cfg.model, Layout.from_config(cfg))
    assert whole == 12 * cfg.model.num_params() and per_rank == whole / 8  # fp32 masters and two moments
    t = cfg.train
    estimate = estimate_plan(cfg.model, Workload(t.seq_len, t.micro_batch_size, t.global_batch_size),
                             Layout.from_config(cfg), gpu("h100"))
    assert estimate.checkpoint_bytes == whole and estimate.checkpoint_rank_bytes == per_rank
    assert estimate.checkpoint_save_s == pytest.approx(per_rank / (6e9 / 8))
    lora = load_config("llama2-7b", {"lora.rank": "16"})
    whole, per_rank = save_bytes(lora.model, Layout.from_config(lora))
    assert whole == 12 * lora.lora.adapter_count(lora.model) + 2 * lora.model.num_params() == per_rank  # bf16 base
    # Frozen experts split over ep: each ep rank writes its block (planned as written by every rank whole)
    moe = load_config("mixtral-8x7b", {"parallel.dp": "8", "parallel.ep": "8", "parallel.zero_stage": "3",
                                       "train.freeze": "experts,router"})
    whole, per_rank = save_bytes(moe.model, Layout.from_config(moe))
    assert per_rank == pytest.approx(whole / 8, rel=0.01)  # beside them, the routers (4 MB) on every rank
    assert grace_warning(cfg) is None  # 9.4 GB a rank at 6/8 GB/s: 13 s
    said = grace_warning(load_config("llama2-7b", {}), disk_bw=1e9)  # 81 GB at 1 GB/s
    assert said is not None and "81 s" in said and "train.save_every" in said


def test_a_sharded_checkpoint_exports_in_shards_that_transformers_loads(tmp_path):
    """The export reads each tensor from the pieces when it is written, in files of about max_shard_bytes with
    transformers' index: the same model as the one-file export of the full format's checkpoint."""
    import torch
    import transformers
    from shardlm.checkpoint import load_checkpoint
    from shardlm.config import config_from_dict
    from shardlm.model.hf import write_hf_dir
    over = {"train.steps": "2", "parallel.zero_stage": "1"}
    run_distributed(dist_fns.train_and_capture, 2, over, str(tmp_path / "sharded"), timeout=240)
    run_distributed(dist_fns.train_and_capture, 2, {**over, "train.checkpoint_format": "full"}, str(tmp_path / "full"),
                    timeout=240)
    models = {}
    for kind, limit in (("sharded", 40_000), ("full", 2**30)):
        ckpt = load_checkpoint(tmp_path / kind, with_optimizer=False)
        cfg = config_from_dict(ckpt["state"]["config"]).model
        write_hf_dir(ckpt["model"], cfg, tmp_path / f"hf-{kind}", max_shard_bytes=limit)
        models[kind] = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"hf-{kind}")
    assert len(list((tmp_path / "hf-sharded").glob("model-*.safetensors"))) > 1
    assert (tmp_path / "hf-sharded" / "model.safetensors.index.json").is_file()
    ids = torch.arange(12)[None] % 200
    torch.testing.assert_close(models["sharded"](ids).logits, models["full"](ids).logits, rtol=1e-5, atol=1e-5)
    for name, tensor in models["full"].state_dict().items():  # the same training: the same bits, however saved
        assert torch.equal(models["sharded"].state_dict()[name], tensor), name


def test_a_rank_reads_only_the_pieces_that_overlap_what_it_holds(tmp_path):
    """Saved at dp 2 ZeRO-3, resumed at the same layout: each rank opens its own files alone (its shard is
    what it wrote); one process opens them all. The same masters either way."""
    zero3 = {"parallel.zero_stage": "3", "train.steps": "2", "train.save_every": "2"}
    run_distributed(dist_fns.train_and_capture, 2, zero3, str(tmp_path / "a"), timeout=240)
    ckpt = str(tmp_path / "a" / "checkpoints" / "step_00000002")
    both = run_distributed(dist_fns.files_read_at_resume, 2, {"parallel.zero_stage": "3"}, ckpt, timeout=240)
    for rank, (opened, _) in enumerate(both):
        assert opened and all(name.startswith(f"rank{rank:05d}-") for name in opened), (rank, opened)
    opened, alone = dist_fns.files_read_at_resume(0, 1, {}, ckpt)
    assert {n[:9] for n in opened} == {"rank00000", "rank00001"}
    gathered = both[0][1]
    assert gathered.keys() == alone.keys() and all(torch.equal(gathered[k], alone[k]) for k in alone)


def test_a_checkpoint_of_many_files_is_read_with_few_open(tmp_path):
    """A reader keeps only its most recently read files open (a 70B checkpoint is thousands of files, past a
    process's open-file limit), and reads the same tensors."""
    import json
    import os

    from shardlm.checkpoint import MANIFEST, load_checkpoint
    from shardlm.sharded_read import ShardedState
    dist_fns.train_and_capture(0, 1, {**MODEL, "train.steps": "1", "train.save_every": "1"}, str(tmp_path / "a"))
    ckpt = tmp_path / "a" / "checkpoints" / "step_00000001"
    files = list(ckpt.glob("rank*.safetensors"))
    assert len(files) > 8
    state = ShardedState(ckpt, json.loads((ckpt / MANIFEST).read_text()))
    state.OPEN_FILES = 3
    masters = state.masters()

    def held() -> set[str]:  # the checkpoint's files this process has open or mapped
        links = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                links.add(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:  # the listing's own descriptor, closed by now
                pass
        maps = {line.split(maxsplit=5)[-1] for line in open("/proc/self/maps").read().splitlines() if "/" in line}
        return {f for f in links | maps if f.startswith(str(ckpt))}
    read, most = {}, 0
    for name in masters:
        read[name] = masters[name]
        most = max(most, len(held()))
    assert 0 < most <= 3, most
    whole = load_checkpoint(ckpt)["model"]
    assert read.keys() == set(whole) and all(torch.equal(read[k], whole[k]) for k in read)


STEPS = {"train.steps": "6", "train.save_every": "3", "train.keep_checkpoints": "5"}
# Layouts the strategies' own resharding tests do not save from (theirs: pp 2 x tp 2, tp 2 x dp 2, cp 2 at
# dp 1, LoRA at one process, the offload layouts as targets).
SOURCES = {
    "dp2-cp2-zero3": (4, {"parallel.dp": "2", "parallel.cp": "2", "parallel.zero_stage": "3"}),
    "pp2-lora": (2, {"parallel.pp": "2", "parallel.dp": "1", "lora.rank": "4", "lora.alpha": "8",
                     "lora.targets": "q_proj,v_proj,o_proj,gate_proj,down_proj", "train.micro_batch_size": "2"}),
    "dp2-zero2-offload": (2, {"parallel.dp": "2", "parallel.zero_stage": "2", "parallel.offload": "optimizer"}),
}


@pytest.mark.parametrize("source", list(SOURCES))
def test_a_checkpoint_of_each_layout_resumes_at_one_process_on_the_same_trajectory(tmp_path, source):
    world, layout = SOURCES[source]
    full = run_distributed(dist_fns.train_and_capture, world, {**STEPS, **layout}, str(tmp_path / "a"), timeout=240)
    ckpt = str(tmp_path / "a" / "checkpoints" / "step_00000003")
    one = {**STEPS, **{k: v for k, v in layout.items() if k.startswith(("lora.", "train."))}, "parallel.dp": "1",
           "train.device": "cpu"}
    resumed = dist_fns.train_and_capture(0, 1, one, str(tmp_path / "b"), ckpt)
    torch.testing.assert_close(resumed["losses"], full[0]["losses"][3:], rtol=RTOL, atol=0)


def test_a_job_killed_mid_save_on_every_rank_leaves_the_previous_checkpoint_to_resume_from(tmp_path):
    """Both ranks SIGKILLed after writing the first file of step 4's save (as a node's failure or a launcher's
    kill -9 would leave it): step 2's checkpoint is whole, and a resume continues from it to the end."""
    over = {"train.steps": "4", "train.save_every": "2", "train.keep_checkpoints": "5", "parallel.zero_stage": "3"}
    with pytest.raises(DistributedError, match="died"):
        run_distributed(dist_fns.killed_after_the_first_file_of, 2, over, str(tmp_path), 4, timeout=120)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == [".tmp-step_00000004", "step_00000002"], names
    resumed = dist_fns.train_and_capture(0, 1, {**over, "parallel.dp": "1", "train.device": "cpu"}, str(tmp_path),
                                         str(tmp_path))
    assert len(resumed["losses"]) == 2  # steps 3 and 4, from step 2's checkpoint
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]


def test_a_save_longer_than_the_grace_period_is_warned_of_when_the_run_starts(tmp_path, monkeypatch):
    from shardlm import run_checkpoint
    from shardlm.config import load_config
    from shardlm.trainer import Trainer
    said = []
    cfg = load_config("tiny", {"train.tensorboard": "false"})
    Trainer(cfg, out_dir=tmp_path / "quick", log=said.append).close()
    assert not any("SIGTERM" in m for m in said)  # a tiny model saves in far less than 30 s
    monkeypatch.setattr(run_checkpoint, "GRACE_S", 0)  # as though the disk were slow beside the state
    Trainer(cfg, out_dir=tmp_path / "slow", log=said.append).close()
    assert any("more than the 0 s torchrun and Slurm leave after SIGTERM" in m for m in said), said


@pytest.mark.timeout(120)
def test_a_disk_that_fills_at_the_manifest_fails_the_save_with_its_message(tmp_path, monkeypatch):
    """The pieces fit and the disk fills at the manifest, written last but state.json: the save raised the bare
    OSError (a traceback; under torchrun the other ranks waited on rank 0 until the timeout) and left its
    temporary directory."""
    import errno
    import pathlib

    from shardlm.checkpoint import CheckpointError
    from shardlm.config import load_config
    from shardlm.trainer import Trainer
    real = pathlib.Path.write_text

    def full_at_the_manifest(self, *args, **kwargs):
        if self.name == "manifest.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, *args, **kwargs)
    cfg = load_config("tiny", {"train.steps": "2", "train.tensorboard": "false"})
    trainer = Trainer(cfg, out_dir=tmp_path / "r", log=lambda *a: None)
    monkeypatch.setattr(pathlib.Path, "write_text", full_at_the_manifest)
    with pytest.raises(CheckpointError, match="saving step 2 .* failed: No space left on device; no earlier"):
        trainer.run()
    assert list((tmp_path / "r" / "checkpoints").iterdir()) == []
    trainer.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_pipeline_stages_of_unequal_layers_resume_their_own_dropout_streams(tmp_path, fmt):
    """pp 2 over 3 layers with LoRA dropout: the stages draw unequal numbers from their RNGs each step. rng.pt held
    rank 0's state alone, which every rank took on resume, so the resumed losses left the uninterrupted run's."""
    over = {"parallel.pp": "2", "parallel.dp": "1", "model.num_layers": "3", "lora.rank": "4", "lora.alpha": "8", "lora.dropout": "0.1",
            "lora.targets": "q_proj,v_proj,o_proj,gate_proj,down_proj", "train.micro_batch_size": "2",
            "train.steps": "4", "train.save_every": "2", "train.keep_checkpoints": "5",
            "train.checkpoint_format": fmt, "train.tensorboard": "false"}
    full = run_distributed(dist_fns.train_and_capture, 2, over, str(tmp_path / "a"), timeout=120)
    ckpt = str(tmp_path / "a" / "checkpoints" / "step_00000002")
    resumed = run_distributed(dist_fns.train_and_capture, 2, over, str(tmp_path / "b"), ckpt, timeout=120)
    assert resumed[0]["losses"] == full[0]["losses"][2:]


@pytest.mark.timeout(200)
def test_an_out_that_is_not_shared_by_every_rank_is_refused_before_training(tmp_path):
    """A sharded checkpoint is written by every rank into rank 0's --out: one local to each node (the default
    runs/... in each node's own working directory) trained the whole run and failed at its save on the other
    nodes, every step lost. Refused at the start, on every rank; gathered checkpoints, which rank 0 alone
    writes, train."""
    said = run_distributed(dist_fns.train_into_own_out, 2, str(tmp_path / "sharded"), {}, timeout=150)
    assert said[1].startswith(f"--out {tmp_path / 'sharded' / 'rank1'}: rank 1 (on "), said
    assert "does not see the files rank 0 writes there (a directory local to each node?)" in said[1], said
    assert "some ranks do not see the files rank 0 writes there" in said[0], said
    assert not (tmp_path / "sharded" / "rank0").exists()  # the refused run leaves no directory behind
    said = run_distributed(dist_fns.train_into_own_out, 2, str(tmp_path / "full"),
                           {"train.checkpoint_format": "full"}, timeout=150)
    assert said == [None, None]
    assert (tmp_path / "full" / "rank0" / "checkpoints" / "step_00000001" / "state.json").is_file()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("over", [{"lora.rank": "4"}, {"train.optimizer_dtype": "bf16"}], ids=["lora", "bf16-optimizer"])
@pytest.mark.parametrize("async_", ["false", "true"])
def test_16_bit_state_is_written_in_16_bits_as_the_planner_counts(tmp_path, over, async_):
    """Every piece was written in fp32: a LoRA run's bf16 base (a QLoRA one's dequantised) took twice its bytes
    in every checkpoint, 27 GB for a 7B adapter of 100 MB, and bf16 masters and moments too. 16-bit state is
    written as it is held, as the planner counts it; the run resumes on its trajectory."""
    from shardlm.config import load_config
    from shardlm.plan import Layout, save_bytes
    over = {"train.precision": "bf16", "train.steps": "4", "train.save_every": "2", "train.device": "cpu",
            "train.checkpoint_async": async_, "parallel.dp": "1", **over}
    full = dist_fns.train_and_capture(0, 1, over, str(tmp_path / "a"))
    ckpt = tmp_path / "a" / "checkpoints" / "step_00000002"
    written = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    cfg = load_config("tiny", {"train.tensorboard": "false", **over})
    planned, _ = save_bytes(cfg.model, Layout.from_config(cfg))
    assert planned <= written < planned * 1.05 + 65536, (written, planned)  # beside them, headers and keys
    resumed = dist_fns.train_and_capture(0, 1, over, str(tmp_path / "b"), str(ckpt))
    assert resumed["losses"] == full["losses"][2:]
