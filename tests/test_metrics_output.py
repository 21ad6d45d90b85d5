"""What a training run reports (trainer.py's records, metrics.jsonl): numbers that describe the work done."""
import json
import shutil
import time

import pytest

from shardlm.config import load_config
from shardlm.trainer import Trainer


@pytest.mark.timeout(120)
def test_a_step_skipped_as_untrained_adds_no_tokens_to_tokens_per_s(tmp_path):
    """data.skip_untrained: a step whose global batch held no trained token runs no forward, backward or update,
    yet tokens/s (and MFU from it) counted its global_batch x seq_len tokens as trained: the record of a step
    that trained nothing since the last one showed the same throughput as a real step."""
    cfg = load_config("tiny", {"train.steps": "3", "train.log_every": "1", "train.tensorboard": "false",
                               "train.peak_tflops": "1", "data.skip_untrained": "true"})
    trainer = Trainer(cfg, out_dir=tmp_path / "run", log=lambda *a: None)
    real = trainer.data.trained_tokens
    trainer.data.trained_tokens = lambda step: 0 if step == 1 else real(step)  # step 2 (0-based 1) untrained
    records = trainer.run()
    trainer.close()
    assert [r["loss"] is None for r in records] == [False, True, False]
    skipped = records[1]
    assert skipped["tokens_per_s"] == 0 and skipped["mfu"] == 0, skipped
    assert records[0]["tokens_per_s"] > 0 and records[2]["tokens_per_s"] > 0
    written = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert written[1]["tokens_per_s"] == 0


@pytest.mark.timeout(60)
def test_the_readme_states_the_flops_per_token_that_lora_runs_report_mfu_with():
    """README's Metrics section gave MFU's FLOPs per token as 6 x the matmul parameters + attention for every run,
    but a LoRA run's MFU uses LoRAConfig.flops_per_token: 4 x the frozen ones + 6 x the adapters' + attention."""
    from pathlib import Path
    cfg = load_config("tiny", {"lora.rank": "4", "lora.alpha": "8"})
    m, seq = cfg.model, cfg.train.seq_len
    attention = 12 * m.num_layers * m.num_heads * m.head_size * seq
    frozen = (m.flops_per_token(seq) - attention) // 6
    assert cfg.lora.flops_per_token(m, seq) == 4 * frozen + 6 * cfg.lora.adapter_count(m) + attention
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    metrics = readme.split("### Metrics", 1)[1].split("\n## ", 1)[0]
    assert "LoRA" in metrics and "4 x" in metrics, metrics


def _tensorboard_steps(run, tag="train/loss"):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    return [e.step for e in events.Scalars(tag)]


@pytest.mark.timeout(120)
def test_a_new_run_does_not_show_an_earlier_runs_tensorboard_steps_as_its_own(tmp_path):
    """A run that left no checkpoint (killed before its first save, save_every 0) leaves metrics.jsonl and
    TensorBoard events; a new run into that --out replaced metrics.jsonl but kept the old events beside its
    own: TensorBoard showed steps 1-2 twice and the old run's steps 3-4 as this run's."""
    pytest.importorskip("tensorboard")
    run = tmp_path / "run"
    cfg = load_config("tiny", {"train.steps": "4", "train.sample_tokens": "0"})
    trainer = Trainer(cfg, out_dir=run, log=lambda *a: None)
    trainer.run()
    trainer.close()
    shutil.rmtree(run / "checkpoints")  # as a run killed before it saved leaves its directory
    cfg = load_config("tiny", {"train.steps": "2", "train.sample_tokens": "0", "train.seed": "5"})
    trainer = Trainer(cfg, out_dir=run, log=lambda *a: None)
    trainer.run()
    trainer.close()
    assert _tensorboard_steps(run) == [1, 2]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]


@pytest.mark.timeout(120)
def test_a_resumed_run_reports_its_first_step_at_once(tmp_path):
    """A new run logs its step 1 whatever train.log_every is, so that a long run says it is alive within seconds; a
    resumed one (a requeued job) said nothing until the next multiple of log_every, its console and metrics
    silent for up to log_every steps after the loading."""
    run = tmp_path / "run"
    overrides = {"train.log_every": "5", "train.sample_tokens": "0", "train.tensorboard": "false"}
    trainer = Trainer(load_config("tiny", {**overrides, "train.steps": "3"}), out_dir=run, log=lambda *a: None)
    assert [r["step"] for r in trainer.run()] == [1, 3]
    trainer.close()
    trainer = Trainer(load_config("tiny", {**overrides, "train.steps": "8"}), out_dir=run, resume=run,
                      log=lambda *a: None)
    assert [r["step"] for r in trainer.run()] == [4, 5, 8]
    trainer.close()


@pytest.mark.timeout(60)
def test_a_failed_rewrite_of_metrics_jsonl_on_resume_keeps_its_history(tmp_path):
    """A resume rewrites metrics.jsonl without the steps after its checkpoint; it truncated the file in place,
    so a kill or a full disk during the write lost the run's history. A file-size limit stops the write here."""
    resource = pytest.importorskip("resource")
    from shardlm.config import RunError
    from shardlm.metrics import MetricsLogger
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s, "lr": 3e-4}) + "\n" for s in range(1, 301)))
    before = path.read_bytes()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (len(before) // 4, hard))  # Python ignores SIGXFSZ: writes fail
    try:
        with pytest.raises(RunError, match="it is as it was"):
            MetricsLogger(tmp_path, True, False, resume_step=200)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    MetricsLogger(tmp_path, True, False, resume_step=200).close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == list(range(1, 201))


@pytest.mark.timeout(120)
def test_a_run_without_the_tensorboard_package_says_so_once_at_its_start(tmp_path, monkeypatch):
    """train.tensorboard is on by default, and without the tensorboard package a run wrote no events and said
    nothing: a user expecting TensorBoard found an empty directory and no word why."""
    import sys
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # its import fails, as without the package
    said = []
    trainer = Trainer(load_config("tiny", {"train.steps": "2", "train.sample_tokens": "0"}), out_dir=tmp_path / "on",
                      log=said.append)
    trainer.run()
    trainer.close()
    missing = [s for s in said if "tensorboard package is not installed" in s]
    assert len(missing) == 1, said
    assert "pip install tensorboard" in missing[0] and "train.tensorboard false" in missing[0], missing
    assert not list((tmp_path / "on").glob("tensorboard/events.*"))
    said.clear()
    off = load_config("tiny", {"train.steps": "1", "train.sample_tokens": "0", "train.tensorboard": "false"})
    Trainer(off, out_dir=tmp_path / "off", log=said.append).close()
    assert not [s for s in said if "tensorboard" in s.lower()], said


@pytest.mark.timeout(180)
def test_tensorboard_drops_an_abandoned_futures_steps_when_a_resumed_stretch_ran_without_it(tmp_path):
    """A run killed after step 4 and resumed from its step 2 checkpoint with train.tensorboard false dropped steps
    3-4 from metrics.jsonl but not from TensorBoard: with TensorBoard on again, its steps 3-4 showed the
    abandoned future's losses, which metrics.jsonl's steps 3-4 contradict."""
    pytest.importorskip("tensorboard")
    run = tmp_path / "run"
    quiet = {"train.sample_tokens": "0", "train.save_every": "2"}
    trainer = Trainer(load_config("tiny", {**quiet, "train.steps": "4"}), out_dir=run, log=lambda *a: None)
    trainer.run()
    trainer.close()
    shutil.rmtree(run / "checkpoints" / "step_00000004")  # killed after step 4, before its save
    # TensorBoard reads event files in name order, their first key whole seconds: a later second for each stretch
    time.sleep(1)
    trainer = Trainer(load_config("tiny", {**quiet, "train.steps": "4", "train.tensorboard": "false"}),
                      out_dir=run, resume=run, log=lambda *a: None)
    trainer.run()
    trainer.close()
    assert _tensorboard_steps(run) == [1, 2]
    time.sleep(1)
    trainer = Trainer(load_config("tiny", {**quiet, "train.steps": "6"}), out_dir=run, resume=run,
                      log=lambda *a: None)
    trainer.run()
    trainer.close()
    assert _tensorboard_steps(run) == [1, 2, 5, 6]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == list(range(1, 7))


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA GH200 480GB", 989.0), ("NVIDIA L40", 181.0), ("NVIDIA L40S", 362.0), ("NVIDIA L4", 121.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("Tesla V100-SXM2-16GB", 125.0), ("NVIDIA RTX A1000", None),
    ("NVIDIA GeForce RTX 4080", None)])
def test_mfu_takes_the_peak_of_the_card_named_not_of_one_whose_name_it_contains(name, tflops):
    """The peak was the first key found anywhere in the card's name: an L40 took the L4's (MFU shown 1.5x too
    high), an RTX A1000 the A100's, an H100 PCIe the SXM part's; a card not in the table shows no MFU."""
    from shardlm.metrics import card_peak_tflops
    assert card_peak_tflops(name) == tflops


@pytest.mark.timeout(120)
def test_a_run_keeps_a_bounded_number_of_records_in_memory(tmp_path, monkeypatch):
    """run() kept every record on every rank for the whole run (each MoE layer's statistics: tens of KiB a
    record, gigabytes over a long run); it returns the last RECORDS_KEPT and metrics.jsonl holds them all."""
    import shardlm.trainer
    monkeypatch.setattr(shardlm.trainer, "RECORDS_KEPT", 2)
    cfg = load_config("tiny", {"train.steps": "4", "train.log_every": "1", "train.tensorboard": "false",
                               "train.sample_tokens": "0"})
    trainer = Trainer(cfg, out_dir=tmp_path / "run", log=lambda *a: None)
    records = trainer.run()
    trainer.close()
    assert [r["step"] for r in records] == [3, 4]
    written = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in written] == [1, 2, 3, 4]


@pytest.mark.timeout(180)
def test_a_resume_that_changes_the_micro_batch_says_eval_scores_other_windows(tmp_path):
    """Eval scores train.eval_batches x train.micro_batch_size held-out windows: resumed on another layout with
    another micro batch, its eval_loss stepped at the resume with no word of why, and of the eval_batches that
    keeps the windows."""
    over = {"train.steps": "1", "train.tensorboard": "false", "train.sample_tokens": "0", "train.eval_every": "1",
            "train.global_batch_size": "4", "train.micro_batch_size": "2", "data.eval_windows": "8"}
    trainer = Trainer(load_config("tiny", over), out_dir=tmp_path / "run", log=lambda *a: None)
    trainer.run()
    trainer.close()
    said = []
    for micro, steps in (("1", "2"), ("2", "3")):
        resumed = Trainer(load_config("tiny", {**over, "train.steps": steps, "train.micro_batch_size": micro}),
                          out_dir=tmp_path / "run", resume=tmp_path / "run", log=said.append)
        resumed.run()
        resumed.close()
    notes = [line for line in said if "held-out windows" in line]
    assert notes == ["note: eval scores 4 held-out windows (train.eval_batches 4 x train.micro_batch_size 1), the "
                     "checkpoint's run scored 8; train.eval_batches 8 scores the checkpoint's windows",
                     "note: eval scores 8 held-out windows (train.eval_batches 4 x train.micro_batch_size 2), the "
                     "checkpoint's run scored 4; train.eval_batches 2 scores the checkpoint's windows"], said


@pytest.mark.timeout(120)
def test_mfu_of_a_run_with_frozen_weights_counts_no_weight_gradient_for_them(tmp_path):
    """train.freeze: MFU counted 6 x every matmul parameter, the frozen ones' weight gradients too, which are
    never computed (a LoRA run's frozen base counted 4 x): overstated by up to a third of the frozen share."""
    from shardlm.plan import Layout
    from shardlm.plan.frozen import layout_frozen
    over = {"train.steps": "1", "train.log_every": "1", "train.tensorboard": "false", "train.peak_tflops": "1",
            "train.sample_tokens": "0"}
    per_token = {}
    for freeze in ("", "layers.0"):
        cfg = load_config("tiny", {**over, "train.freeze": freeze})
        trainer = Trainer(cfg, log=lambda *a: None)
        (record,) = trainer.run()
        trainer.close()
        per_token[freeze] = record["mfu"] * 1e12 / record["tokens_per_s"]
    frozen = layout_frozen(cfg.model, Layout.from_config(cfg))
    assert per_token["layers.0"] == pytest.approx(per_token[""] - 2 * sum(frozen.dense), rel=1e-9)


@pytest.mark.timeout(120)
def test_the_logged_loss_is_the_mean_over_the_steps_since_the_last_record(tmp_path):
    """Only every train.log_every-th step's loss was logged: a spike between two records never showed. The
    record's loss is the mean of the steps' since the previous record (HF Trainer's, Megatron's)."""
    over = {"train.steps": "5", "train.tensorboard": "false", "train.sample_tokens": "0"}
    every = Trainer(load_config("tiny", {**over, "train.log_every": "1"}), log=lambda *a: None)
    each = [r["loss"] for r in every.run()]
    every.close()
    sparse = Trainer(load_config("tiny", {**over, "train.log_every": "2"}), log=lambda *a: None)
    records = sparse.run()
    sparse.close()
    assert [r["step"] for r in records] == [1, 2, 4, 5]
    got = [r["loss"] for r in records]
    assert got == pytest.approx([each[0], each[1], (each[2] + each[3]) / 2, each[4]], rel=1e-6)


@pytest.mark.timeout(120)
def test_a_resume_given_another_config_names_the_optimizer_settings_it_changes(tmp_path):
    """`train tiny --resume RUN` takes the preset's values over the run's: a --train.weight_decay 0 given at the
    start went back to 0.1 without a word."""
    over = {"train.steps": "1", "train.tensorboard": "false", "train.sample_tokens": "0"}
    trainer = Trainer(load_config("tiny", {**over, "train.weight_decay": "0", "train.grad_clip": "0.5"}),
                      out_dir=tmp_path / "run", log=lambda *a: None)
    trainer.run()
    trainer.close()
    said = []
    Trainer(load_config("tiny", {**over, "train.steps": "2"}), out_dir=tmp_path / "run", resume=tmp_path / "run",
            log=said.append).close()
    assert ("note: this run's config is not the checkpoint's (train.weight_decay 0.0 -> 0.1, train.grad_clip 0.5 -> "
            "1.0): a resume takes the config and flags given; `shardlm train --resume RUN` alone continues with the "
            "run's own") in said, said
