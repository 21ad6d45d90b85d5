"""Whether a checkpoint, a dataset and a model belong together: what a resumed run may not change, and the
tokenizer a dataset was prepared with against the model's.

A resume continues the same optimisation: every key that changes the model (its shape, its vocabulary), the
adapters (LoRA rank, alpha, rsLoRA, targets, the base's quantisation) or what the token ids mean (the
tokenizer) must be the checkpoint's. Changed, they once ran on silently (other targets dropped the trained
adapters outside them, another alpha rescaled the update mid-run) or ended in a traceback from the optimizer's
state; each is now refused naming the key, both values and what to do. Keys that change only how the same
run is computed (the layout, precision, recomputation, the step count) stay free.

Token ids mean nothing without their tokenizer: a dataset records its tokenizer's fingerprint (a hash of the
vocabulary, added tokens included), which must match the checkpoint's when resuming and `train.init_from`'s
when fine-tuning.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path


from .checkpoint import CheckpointError
from .config import Config, ConfigError, lora_targets
from .mesh import every_rank
from .tokenizer import fingerprint, load_tokenizer


class ResumeMismatch(ConfigError):
    """A resumed run changes a key its checkpoint fixes."""


KEEP = ("leave it out (a resume without a config or override continues with the checkpoint's) or set it back "
        "to {old!r}")


def _lora_change(key: str, old, new, path) -> str:
    if key == "rank" and not old:
        return (f"{path} trained every weight, without adapters: to fine-tune it with LoRA start a new run from it "
                f"(`shardlm export --checkpoint {path} --out BASE`, then --train.init_from BASE --lora.rank {new})")
    if key == "rank" and not new:
        return (f"{path} trained LoRA adapters of rank {old} on a frozen base: to go on without them start a new run "
                f"from the merged model (`shardlm export --merge --checkpoint {path} --out BASE`, then "
                f"--train.init_from BASE), or resume with lora.rank = {old}")
    why = {"rank": "the adapters' shapes would change under the trained ones",
           "alpha": "it would rescale the trained update mid-run (scale = alpha / rank)",
           "rslora": "it would rescale the trained update mid-run",
           "targets": "trained adapters outside the new targets would be dropped, new ones start untrained",
           "quantize": "the adapters were trained on the other base (quantised or not)"}[key]
    return f"{why}; " + KEEP.format(old=old) + ", or start a new run from the merged model (`shardlm export --merge`)"


def check_resume(path: Path, saved: Config, now: Config) -> None:
    """Refuse a resume of checkpoint `path` (saved with `saved`) under `now` that changes the model or adapters,
    or whose saved tensors are not the shapes its config gives them."""
    def refuse(key, old, new, what):
        raise ResumeMismatch(f"cannot resume {path}: {key} is {old!r} in the checkpoint and {new!r} in this run: "
                             f"{what}")

    for f in dataclasses.fields(saved.model):
        if f.name == "capacity_factor":  # which copies training drops, no weight or state: eval and export are dropless
            continue
        old, new = getattr(saved.model, f.name), getattr(now.model, f.name)
        if old != new:
            refuse(f"model.{f.name}", old, new, "it changes the model; " + KEEP.format(old=old))
    if saved.train.freeze != now.train.freeze:  # parameters would enter or leave the optimizer mid-run
        refuse("train.freeze", saved.train.freeze, now.train.freeze,
               "parameters would start or stop training without their optimizer state; resume with "
               f"train.freeze = {saved.train.freeze!r}, or start a new run from this checkpoint's weights "
               f"(`shardlm export --checkpoint {path} --out BASE`, then --train.init_from BASE)")
    if saved.train.optimizer != now.train.optimizer:  # once a KeyError from the optimizer's load
        refuse("train.optimizer", saved.train.optimizer, now.train.optimizer,
               f"its saved optimizer state is {saved.train.optimizer}'s, which {now.train.optimizer} cannot continue "
               "from; " + KEEP.format(old=saved.train.optimizer) + ", or start a new run from this checkpoint's "
               f"weights (`shardlm export --checkpoint {path} --out BASE`, then --train.init_from BASE)")
    s, n = saved.lora, now.lora
    if s.rank != n.rank:
        refuse("lora.rank", s.rank, n.rank, _lora_change("rank", s.rank, n.rank, path))
    for key in ("alpha", "rslora", "quantize") if s.rank else ():
        if getattr(s, key) != getattr(n, key):
            refuse(f"lora.{key}", getattr(s, key), getattr(n, key), _lora_change(key, getattr(s, key), None, path))
    if s.rank and lora_targets(saved.model.arch, s.targets) != lora_targets(now.model.arch, n.targets):
        refuse("lora.targets", s.targets, n.targets, _lora_change("targets", s.targets, n.targets, path))
    check_resume_base(path, saved, now)
    check_resume_shapes(path, now)


def check_resume_base(path: Path, saved: Config, now: Config) -> None:
    """A resume naming another `train.init_from` than its checkpoint's: the weights come from the checkpoint,
    but the run records it as its base (an exported adapter's base_model_name_or_path, the generation config).
    The same model moved elsewhere passes; a directory without it, or of another model, is refused."""
    import copy

    from .hf_config import RESOLVED, WEIGHT_KEYS, with_init_from
    new, old = now.train.init_from, saved.train.init_from
    if not new or new == old:
        return
    theirs = with_init_from(copy.deepcopy(now)).model  # an unreadable directory is refused naming it
    ours = saved.model
    differ = [f"model.{k} is {getattr(ours, RESOLVED.get(k, k))!r} in the checkpoint and "
              f"{getattr(theirs, RESOLVED.get(k, k))!r} there" for k in WEIGHT_KEYS
              if getattr(ours, RESOLVED.get(k, k)) != getattr(theirs, RESOLVED.get(k, k))
              and not (k == "vocab_size" and ours.vocab_size == 0)]
    if differ:
        raise ResumeMismatch(f"cannot resume {path}: train.init_from is {old!r} in the checkpoint and {new!r} in this "
                             f"run, another model ({'; '.join(differ)}), which the run would record as its base: "
                             + KEEP.format(old=old) + ", or name where the checkpoint's base now lies")


def check_resume_shapes(path: Path, cfg: Config) -> None:
    """Every saved tensor must have the shape of the parameter it loads into: a state.json whose model config
    does not describe its tensors (edited by hand, or copied from another run) would load the overlap of each
    and leave the rest of the new, larger parameters at zero, training on as if resumed."""
    import torch

    from .checkpoint import saved_shapes
    from .model import Decoder
    from .parallel.lora import apply_lora
    with torch.device("meta"):
        model = Decoder(cfg.model)
        if cfg.lora.rank:
            apply_lora(model, cfg.lora)
    saved = saved_shapes(path)
    for name, p in model.named_parameters():
        if name in saved and tuple(saved[name]) != tuple(p.shape):
            raise ResumeMismatch(f"cannot resume {path}: {name} is saved as {list(saved[name])}, but the model "
                                 f"config in its state.json makes it {list(p.shape)}: that config does not "
                                 f"describe the saved tensors; put back the one they were saved with")


# What a resume reads from state.json besides the config: edited by hand, a missing or mistyped one ended the
# resume in a KeyError's or TypeError's traceback.
RECORDS = (("step", int, "an integer"), ("data", dict, "an object"), ("data.consumed_samples", int, "an integer"),
           ("data.train_windows", int, "an integer"), ("data.seed", int, "an integer"),
           ("loss_scaler", dict, "an object"))


def check_state_records(path: Path, state: dict) -> None:
    """Refuse a state.json of checkpoint `path` without a record a resume reads, or with one of another type."""
    for key, kind, what in RECORDS:
        section, _, name = key.rpartition(".")
        holder = state[section] if section else state
        if name not in holder:
            why = f"lacks {key}"
        elif not isinstance(holder[name], kind):
            why = f"holds {key} as {holder[name]!r}, not {what}"
        else:
            continue
        raise CheckpointError(f"cannot resume {path}: its state.json {why} (edited by hand?): put back the "
                              "state.json the run saved, or resume another checkpoint")


def _held_out_change(saved: dict, now) -> tuple | None:
    """The eval setting (data section `saved` in the checkpoint, `now` in this run) that changed the windows
    data.path holds out for eval, which it does only without data.eval_path: (key, old, new), or None. A path
    counts as given or not (the checkpoint keeps it absolute)."""
    old_path, old_windows = saved.get("eval_path"), saved.get("eval_windows")
    if old_path is not None and bool(old_path) != bool(now.eval_path):
        return "eval_path", old_path, now.eval_path
    if not old_path and not now.eval_path and old_windows is not None and old_windows != now.eval_windows:
        return "eval_windows", old_windows, now.eval_windows
    return None


def check_resume_data(path: Path, state: dict, train_windows: int, seed: int, global_batch: int,
                      seq_len: int, data_cfg) -> None:
    """The sample order continues only over the same windows, seed and whole global batches (`data_cfg`: this
    run's data section, to name an eval setting that changed the windows)."""
    check_state_records(path, state)
    data = state["data"]
    if data["train_windows"] != train_windows or data["seed"] != seed:
        # The windows are the data cut at train.seq_len, less those held out for eval: a changed seq_len or
        # eval setting alone was blamed on data.path.
        saved_cfg = state["config"]
        saved = saved_cfg["train"]["seq_len"]
        held = _held_out_change(saved_cfg.get("data", {}), data_cfg) if data["seed"] == seed else None
        if saved != seq_len:
            how = f"train.seq_len is {saved} in the checkpoint and {seq_len} in this run: " + KEEP.format(old=saved)
        elif held:
            key, old, new = held
            how = (f"data.{key} is {old!r} in the checkpoint and {new!r} in this run, which changes the windows left "
                   "to train on (without data.eval_path, the eval windows are held out of data.path): "
                   + KEEP.format(old=old))
        else:
            how = "resume with the checkpoint's data.path and train.seed"
        raise ResumeMismatch(f"cannot resume {path}: its data ({data['train_windows']} windows, seed {data['seed']}) "
                             f"differs from this run's ({train_windows}, {seed}); the sample order would not "
                             f"continue: {how}")
    if data["consumed_samples"] % global_batch:
        saved = state["config"]["train"]["global_batch_size"]
        raise ResumeMismatch(f"cannot resume {path} with train.global_batch_size {global_batch}: "
                             f"{data['consumed_samples']} samples were consumed, not a whole number of batches; "
                             + KEEP.format(old=saved) + f", or resume into another --out with one that divides "
                             f"{data['consumed_samples']}")


def warn_changed_data(path: Path, state: dict, shards, log) -> None:
    """Warn (through `log`; None: say nothing) where the data's identity (TokenShards.identity) is not the one
    checkpoint `path` recorded: as many windows, the same tokenizer and seed, other tokens. Not refused: a corpus
    corrected on purpose (as many windows) may go on, but not as a reproduction of the run. A checkpoint saved before the
    identity was recorded says nothing."""
    if log is None or (saved := state["data"].get("digest")) is None or saved == (now := shards.identity())["digest"]:
        return
    tokens = state["data"].get("tokens")
    n = now["tokens"]
    what = (f"as many tokens, {n:,}, but other ones" if tokens == n else
            f"{n:,} tokens now, {tokens:,} then" if isinstance(tokens, int) else f"{n:,} tokens, other ones")
    log(f"warning: the training data in {shards.dir} is not the data checkpoint {path} was trained on ({what}; "
        f"digest {now['digest']} now, {saved} then): the run goes on over this data, but its trajectory will not "
        "reproduce the one it resumes")


def data_fingerprint(data_dir: Path, index: dict, tokenizer) -> str:
    """The fingerprint of the tokenizer `data_dir` was prepared with: the one its index records (datasets of
    earlier versions record none: their copy of the tokenizer's), which its copy must still match."""
    have = fingerprint(tokenizer)
    recorded = index.get("tokenizer_fingerprint")
    if recorded is not None and recorded != have:
        raise ConfigError(f"{data_dir}/tokenizer.json is not the tokenizer the data was prepared with (fingerprint "
                          f"{have}, index.json records {recorded}): prepare the data again")
    return have


def _mismatch(data_dir: Path, fp: str, tokenizer, other: str, other_tok) -> str:
    return (f"data.path {str(data_dir)!r} was prepared with another tokenizer than {other} (vocabulary "
            f"{tokenizer.vocab_size}, fingerprint {fp}; {other}: {other_tok.vocab_size}, {fingerprint(other_tok)}): "
            "the token ids would mean other tokens to the model")


def check_tokenizer(cfg: Config, data_dir: Path, index: dict, tokenizer, checkpoint: Path | None, log=print) -> None:
    """The data's tokenizer against the model's: the checkpoint's when resuming, else train.init_from's; and
    data.eval_path's against data.path's (an eval loss over other ids is no loss of this model)."""
    fp = data_fingerprint(data_dir, index, tokenizer)
    if cfg.data.eval_path and (Path(cfg.data.eval_path) / "tokenizer.json").is_file():
        theirs = load_tokenizer(cfg.data.eval_path)
        if fingerprint(theirs) != fp:
            raise ConfigError(_mismatch(data_dir, fp, tokenizer, f"data.eval_path = {cfg.data.eval_path!r}", theirs)
                              + "; prepare both with one tokenizer")
    if checkpoint is not None:
        if (checkpoint / "tokenizer.json").is_file():
            theirs = load_tokenizer(checkpoint)
            if fingerprint(theirs) != fp:
                raise ResumeMismatch(f"cannot resume {checkpoint}: " + _mismatch(data_dir, fp, tokenizer,
                                     "the checkpoint's", theirs) + "; resume with the data it was trained on")
        return
    init = cfg.train.init_from
    if not init:
        return
    if not (Path(init) / "tokenizer.json").is_file():
        log(f"note: train.init_from = {init!r} has no tokenizer.json: the data's tokenizer cannot be checked "
            "against the model's")
        return
    theirs = load_tokenizer(init)
    if fingerprint(theirs) != fp:
        raise ConfigError(_mismatch(data_dir, fp, tokenizer, f"train.init_from = {init!r}", theirs)
                          + f"; prepare the data again with --tokenizer {init}")


def non_finite_init(cfg: Config) -> str | None:
    """Why a first step's numbers were not finite when train.init_from's own weights are not (named), else None:
    the initialisation that model.init_std sets is not the one in use."""
    if not cfg.train.init_from:
        return None
    import torch

    from .model.hf import open_hf_dir
    _, tensors = open_hf_dir(cfg.train.init_from)
    for name in tensors.names:
        if not bool(torch.isfinite(tensors(name)).all()):
            return (f"train.init_from = {cfg.train.init_from!r} holds non-finite weights ({name} has nan or inf): "
                    "the checkpoint is damaged or was saved from a diverged run; start from another")
    return None


def not_prepared(path: str) -> str:
    """Why data.path is no prepared dataset: a missing path, or a text file given where its tokens go, was told
    "not a prepared data directory" as a directory of something else is."""
    if Path(path).name == "index.json" and Path(path).is_file():  # the directory's index named, not the directory
        return f"data.path = {path!r} is a prepared directory's index: give the directory, {str(Path(path).parent)!r}"
    if Path(path).is_file():
        return (f"data.path = {path!r} is a file; training reads a directory of token shards: shardlm data prepare "
                f"--input {path} --tokenizer byte (or a tokenizer.json) --out DIR, then data.path = DIR")
    what = "is not a prepared data directory (no index.json)" if os.path.lexists(path) else "does not exist"
    return f"data.path = {path!r} {what}: make one with `shardlm data prepare`"


def check_trainable(data_dir: Path, index: dict) -> None:
    """Instruction data in which no example has a trained token (datasets of earlier versions: `data prepare`
    now refuses to write one) would train at a loss of 0 and learn nothing."""
    untrained = index.get("untrained_examples", 0)
    if index.get("loss_mask") and 0 in (index.get("trained_tokens"), index.get("examples", 1) - untrained):
        raise ConfigError(f"{data_dir}: no example has a token to train on (prompts cut at --pad-to): fix the data "
                          "and prepare it again")


def untrained_step(step: int, data_dir: Path, resume: str | None = None) -> str:
    """`resume`: the command that continues the steps saved before this one, where some were."""
    done = "step 1 is" if step == 2 else f"steps 1-{step - 1} are"
    fix = (f"{done} saved: continue them with `{resume} --data.skip_untrained true`, which skips "
           "such steps (counted in the metrics), or fix the data" if resume else
           "fix the data, or set data.skip_untrained = true to skip such steps (counted in the metrics)")
    return (f"step {step}: no token of its batch is trained on ({data_dir}: prompts cut at --pad-to, or packed "
            f"windows that hold only prompt tokens), so its loss would read 0: {fix}")


def data_notes(t, data_dir: Path, data, resumed: bool = False) -> list[str]:
    """What a run on this data would do that a user does not see (`t`: the train section, `data`: TrainData): no
    eval, a batch larger than the data, more than one pass over it, or examples never trained on. A tiny
    instruction set trained 16 copies of its one window a step and silently left out the examples past it."""
    notes = []
    if t.eval_every and not len(data.eval_range):  # else eval_loss is null, unexplained
        notes.append(f"note: train.eval_every = {t.eval_every} but nothing is held out for eval ({data_dir} is under "
                     "ten windows, or data.eval_windows = 0): set data.eval_path, or train.eval_every = 0")
    held = len(data.eval_range) if data.eval is data.train else 0
    # (not on a resume: the windows trained on are the checkpoint's to keep)
    if not t.eval_every and held and 100 * held >= data.train_windows and not resumed:  # a small instruction set's last examples
        notes.append(f"note: the last {held} windows of {data_dir} are held out for eval and never trained on, and "
                     "train.eval_every = 0 evaluates none: set data.eval_windows = 0 to train on them, or "
                     "train.eval_every to evaluate them")
    shards = data.train.shards
    if not shards.pad_to:  # packed: each shard's tail short of a window fills none
        total = sum(len(x) for x in shards.tokens)
        left = sum(len(x) - ((len(x) - 1) // t.seq_len * t.seq_len + 1 if len(x) > t.seq_len else 0)
                   for x in shards.tokens)
        if left >= 0.01 * total:
            fix = f"; --pad-to {t.seq_len} in `data prepare` gives each example a window" if shards.masks else ""
            notes.append(f"note: {left:,} of {data_dir}'s {total:,} tokens ({100 * left / total:.0f}%) fill no whole "
                         f"window of train.seq_len + 1 = {t.seq_len + 1} tokens and are never trained on{fix}")
    if data.train_windows < t.global_batch_size:
        n = data.train_windows
        notes.append(f"note: {data_dir} holds {n} training window{'s' * (n != 1)}, fewer than "
                     f"train.global_batch_size = {t.global_batch_size}: every step's batch repeats "
                     f"{'them' if n > 1 else 'it'} ({t.global_batch_size / n:.1f} times over); lower "
                     "train.global_batch_size (and train.micro_batch_size) to see each once a step")
    elif t.steps * t.global_batch_size > data.train_windows:  # a small set trained over and over, unsaid
        n, samples = data.train_windows, t.steps * t.global_batch_size
        notes.append(f"note: {t.steps:,} steps of {t.global_batch_size} windows read {samples:,}, {samples / n:.1f} "
                     f"passes over {data_dir}'s {n:,} training windows (reshuffled each pass): train.steps = "
                     f"{n // t.global_batch_size} is one pass")
    return notes


def located(config: dict) -> dict:
    """The config a checkpoint records, its local paths made absolute: `--resume` reads them from the checkpoint,
    and relative ones (data.path = "data") named nothing when resumed from another directory (a job script's),
    the run refused with "does not exist"."""
    for section, key in (("data", "path"), ("data", "eval_path"), ("train", "init_from"), ("parallel", "offload_dir")):
        value = config[section][key]
        if value and os.path.exists(value):
            config[section][key] = os.path.abspath(value)
    return config


def check_same_data(data, train_path, eval_path) -> None:
    """Refuse ranks that read other tokens (a node's own copy of the data, prepared again or from other text):
    each trained on what it read, silently. An index holds no path, and lists its shards' token counts and
    CRC32s, which the loader checked against the files; copies at other paths pass."""
    def tokens(windows):
        return hashlib.sha256(json.dumps(windows.shards.index, sort_keys=True).encode()).hexdigest()
    mine = ((tokens(data.train), str(train_path)), (tokens(data.eval), str(eval_path)))
    every = every_rank(mine)
    for key, i in (("data.path", 0), ("data.eval_path", 1)):
        for rank, theirs in enumerate(every):
            if theirs[i][0] != every[0][i][0]:
                raise ConfigError(f"rank {rank} reads other data than rank 0: its {key} {theirs[i][1]!r} holds "
                                  f"other shards than rank 0's {every[0][i][1]!r} (their index.json files differ): "
                                  "every rank must read the same prepared data")


def train_data_dir(cfg: Config) -> Path:
    """The prepared data a run trains on: data.path (refused where it is not prepared), else the embedded default
    corpus, which the main rank prepares (with progress) while the others wait, each stopping on its error (an
    unwritable cache had the others wait out the process group's timeout)."""
    if cfg.data.path:
        if not (Path(cfg.data.path) / "index.json").is_file():  # before its tokenizer is looked for
            raise ConfigError(not_prepared(cfg.data.path))
        from .data.loader import read_index
        read_index(Path(cfg.data.path))  # another tool's index.json: said so before its tokenizer is looked for
        return Path(cfg.data.path)
    from .data.default import default_corpus
    from .runtime.first_rank import first_rank_result
    first_rank_result(lambda moved: default_corpus(progress=True, moved=moved), stall_s=cfg.parallel.timeout_s,
                      what="rank 0's preparation of the default corpus")
    return default_corpus()  # this node's copy: a node without a shared home prepares its own
