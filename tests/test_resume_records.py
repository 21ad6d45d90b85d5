"""Resumes from checkpoint records a user changed or named by mistake: a state.json edited by hand (a record
missing, or of another type) and a save's unfinished temporary directory given to --resume. Each ends before
training in one line naming the file and what to do, never in a traceback."""
import json
import os
import shutil

import pytest

from helpers import TEXT, cli_proc
from shardlm.config import load_config
from shardlm.trainer import Trainer


def _run(path, steps=1, save_every=0):
    cfg = load_config("tiny", {"train.steps": str(steps), "train.save_every": str(save_every),
                               "train.tensorboard": "false", "train.sample_tokens": "0"})
    Trainer(cfg, out_dir=path, log=lambda *a: None).run()
    return path


def _drop(key):
    def edit(state):
        section, _, name = key.rpartition(".")
        del (state[section] if section else state)[name]
    return edit


def _set(key, value):
    def edit(state):
        section, _, name = key.rpartition(".")
        (state[section] if section else state)[name] = value
    return edit


@pytest.mark.parametrize("edit, said", [
    (_drop("data.consumed_samples"), "state.json lacks data.consumed_samples"),
    (_drop("data.train_windows"), "state.json lacks data.train_windows"),
    (_set("data.consumed_samples", "1"), "state.json holds data.consumed_samples as '1'"),
    (_drop("loss_scaler"), "state.json lacks loss_scaler"),
    (_set("config", None), "state.json holds no config"),
    (_set("files", {"rng.pt": 5}), "state.json records rng.pt as 5"),
], ids=["no-consumed", "no-windows", "consumed-a-string", "no-scaler", "config-null", "files-bad"])
def test_a_hand_edited_state_json_is_refused_in_one_line(tmp_path, capsys, edit, said):
    """Each once ended the resume in a KeyError's, TypeError's or AttributeError's traceback."""
    run = _run(tmp_path / "run")
    ckpt = run / "checkpoints" / "step_00000001"
    state = json.loads((ckpt / "state.json").read_text())
    edit(state)
    (ckpt / "state.json").write_text(json.dumps(state))
    proc = cli_proc(capsys, "train", "--resume", ckpt, "--train.steps", "2", "--out", tmp_path / "out")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode in (1, 2) and len(lines) == 1, proc.stderr
    assert lines[0].startswith("shardlm train: error: ") and said in lines[0], lines[0]
    assert not (tmp_path / "out" / "checkpoints").exists()


@pytest.mark.parametrize("how", ["saved-config", "named-config", "other-out"])
def test_an_unfinished_save_named_as_resume_is_refused_naming_the_run(tmp_path, capsys, how):
    """A save cut short (its .tmp-step_N directory) named as --resume: once 'holds no complete checkpoint (looked
    for .tmp-step_N/checkpoints/step_*/state.json)', its own directory taken as --out, and nothing said of the
    run's complete checkpoints beside it; with a config named, the run removed it as unfinished first and then
    said it did not exist."""
    run = _run(tmp_path / "run", steps=2, save_every=1)
    partial = run / "checkpoints" / ".tmp-step_00000003"
    partial.mkdir()
    (partial / "rank00000-0000.safetensors").write_bytes(b"half")
    extra = {"saved-config": [], "named-config": ["tiny", "--train.tensorboard", "false"],
             "other-out": ["tiny", "--out", tmp_path / "other"]}[how]
    proc = cli_proc(capsys, "train", *extra, "--resume", partial, "--train.steps", "4")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode in (1, 2) and len(lines) == 1, proc.stderr
    assert lines[0] == (f"shardlm train: error: {partial} is the unfinished save of step 3 (cut short by a crash or "
                        f"kill, or still being written), not a checkpoint: name its run {run} instead (its newest "
                        "complete checkpoint: step_00000002)"), lines[0]
    assert sorted(os.listdir(partial)) == ["rank00000-0000.safetensors"]  # left as it was, for the user to see
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == [".tmp-step_00000003", "step_00000001",
                                                                         "step_00000002"]


def test_a_resume_with_nothing_to_do_writes_no_config_into_another_out(tmp_path, capsys):
    """A run at step 2 resumed with train.steps 1 into another --out: 'nothing to do', and that --out held the
    config.toml of a run that never trained (train.steps 1), which `--resume` of it then called a run that had
    saved no checkpoint yet: 'wait for its first', which never came."""
    run, other = _run(tmp_path / "run", steps=2), tmp_path / "other"
    proc = cli_proc(capsys, "train", "--resume", run, "--train.steps", "1", "--out", other,
                    "--train.tensorboard", "false")
    assert proc.returncode == 0 and "nothing to do" in proc.stdout, proc.stderr
    assert not (other / "config.toml").exists()
    proc = cli_proc(capsys, "train", "--resume", other)
    assert proc.returncode == 2 and "wait for its first" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("named", [False, True], ids=["saved-config", "named-config"])
def test_a_saved_config_this_version_cannot_read_is_named_as_the_checkpoints(tmp_path, capsys, named):
    """A key in the checkpoint's config that this version does not know (a newer version's, or an edit): once
    "unknown config key 'train.bogus'", as if the user had passed it."""
    run = _run(tmp_path / "run")
    state_json = run / "checkpoints" / "step_00000001" / "state.json"
    state = json.loads(state_json.read_text())
    state["config"]["train"]["bogus"] = 1
    state_json.write_text(json.dumps(state))
    proc = cli_proc(capsys, "train", *(["tiny"] if named else []), "--resume", run, "--train.steps", "2",
                    "--out", tmp_path / "out")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("shardlm train: error: the config saved in ") and str(run) in lines[0], lines[0]
    assert "unknown config key 'train.bogus'" in lines[0] and "another version of shardlm" in lines[0], lines[0]


def test_a_damaged_checkpoint_moved_aside_named_as_resume_points_to_its_run(tmp_path, capsys):
    """--resume RUN/checkpoints/damaged-step_N (one a resume moved aside): once '--out ... is a checkpoint, not a
    run directory: train into another --out', the checkpoint taken as the run's default --out."""
    run = _run(tmp_path / "run", steps=2, save_every=1)
    aside = run / "checkpoints" / "damaged-step_00000002"
    (run / "checkpoints" / "step_00000002").rename(aside)
    with open(aside / "rank00000-0000.safetensors", "r+b") as f:
        f.truncate(100)
    proc = cli_proc(capsys, "train", "--resume", aside, "--train.steps", "4")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"shardlm train: error: {aside}/rank00000-0000.safetensors has 100 bytes"), lines[0]
    assert lines[0].endswith(f"; --resume {run} instead takes the newest of its checkpoints that verifies"), lines[0]


def test_a_checkpoint_outside_a_run_resumed_without_out_says_why_it_is_the_out(tmp_path, capsys):
    """A checkpoint copied out of its run, resumed without --out: once only '--out CKPT is a checkpoint, not a run
    directory', naming an --out the user never gave."""
    import shutil
    run = _run(tmp_path / "run")
    copy = tmp_path / "saved"
    shutil.copytree(run / "checkpoints" / "step_00000001", copy)
    proc = cli_proc(capsys, "train", "--resume", copy, "--train.steps", "2")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0] == (f"shardlm train: error: --out {copy} is a checkpoint, not a run directory: train into another "
                        "--out (without one, --resume of a checkpoint outside a run's checkpoints folder takes the "
                        "checkpoint as --out)"), lines[0]
    proc = cli_proc(capsys, "train", "--resume", copy, "--train.steps", "2", "--out", tmp_path / "new",
                    "--train.tensorboard", "false")
    assert proc.returncode == 0, proc.stderr


QUIET = ["--train.tensorboard", "false", "--train.sample_tokens", "0"]


def _prepare(data, text):
    (data.parent / f"{data.name}.txt").write_text(text)
    from shardlm.cli import main
    assert main(["data", "prepare", "--input", str(data.parent / f"{data.name}.txt"), "--tokenizer", "byte", "--out",
                 str(data)]) == 0


@pytest.mark.timeout(60)
def test_a_resume_over_data_prepared_again_from_other_text_warns_once(tmp_path, capsys):
    """data.path prepared again from other text that gives as many windows (the same tokenizer and seed): the
    resume went on over other tokens without a word, its trajectory no longer the interrupted run's."""
    data, run = tmp_path / "data", tmp_path / "run"
    _prepare(data, TEXT * 4)
    assert cli_proc(capsys, "train", "tiny", *QUIET, "--train.steps", "1", "--data.path", data, "--out",
                    run).returncode == 0
    shutil.rmtree(data)
    _prepare(data, (TEXT * 4).swapcase())  # as many bytes: as many tokens and windows
    proc = cli_proc(capsys, "train", "--resume", run, "--train.steps", "2")
    said = [line for line in proc.stdout.splitlines() if "will not reproduce" in line]
    assert proc.returncode == 0 and len(said) == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert said[0].startswith(f"warning: the training data in {data} is not the data checkpoint {run}/checkpoints/"
                              "step_00000001 was trained on (as many tokens, 15,841, but other ones; digest "), said[0]
    assert (run / "checkpoints" / "step_00000002").is_dir()


@pytest.mark.timeout(120)
def test_a_resume_over_the_same_data_or_of_an_older_checkpoint_says_nothing(tmp_path, capsys):
    """The embedded default corpus's run resumes as before, without a word; so does a checkpoint saved before the
    data's identity was recorded, whatever its data holds now."""
    run = _run(tmp_path / "run")
    assert "digest" in json.loads((run / "checkpoints" / "step_00000001" / "state.json").read_text())["data"]
    proc = cli_proc(capsys, "train", "--resume", run, "--train.steps", "2")
    assert proc.returncode == 0 and "will not reproduce" not in proc.stdout, proc.stdout + proc.stderr
    data, old = tmp_path / "data", tmp_path / "old"
    _prepare(data, TEXT * 4)
    assert cli_proc(capsys, "train", "tiny", *QUIET, "--train.steps", "1", "--data.path", data, "--out",
                    old).returncode == 0
    state_json = old / "checkpoints" / "step_00000001" / "state.json"
    state = json.loads(state_json.read_text())
    for key in ("tokens", "digest"):
        del state["data"][key]
    state_json.write_text(json.dumps(state))
    shutil.rmtree(data)
    _prepare(data, (TEXT * 4).swapcase())
    proc = cli_proc(capsys, "train", "--resume", old, "--train.steps", "2")
    assert proc.returncode == 0 and "will not reproduce" not in proc.stdout, proc.stdout + proc.stderr
