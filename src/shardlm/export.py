"""`shardlm export`: a run as a Hugging Face directory or a PEFT adapter; where it may write, and writing it whole
or not at all.

An export once went wherever --out said: `--out RUN/checkpoints/step_N` replaced the checkpoint's fp32 weights
with bf16 ones and the run could not resume. Now a checkpoint, a run directory (or its checkpoints folder) and a
prepared dataset are never export targets, and any other directory that is not empty is replaced only with
--overwrite. The export is built in a scratch directory beside --out and swapped in complete (data/swap.py),
so a failed or killed export leaves --out as it was.

--overwrite replaces only what looks like a previous export (files alone, config.json or adapter_config.json
among them): everything in --out is deleted, and `--out . --overwrite` in a project directory must not take the
project, and the run being exported, with it.
"""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

from .checkpoint import CKPT_DIR, STATE
from .config import ConfigError
from .data.prepare import INDEX
from .data.swap import building, remove_leftovers
from .runlock import LOCK_FILE


def _what(path: Path) -> str | None:
    """What shardlm directory `path` is, where it is one an export must not replace."""
    if (path / STATE).is_file() or (path.name.startswith("step_") and path.parent.name == CKPT_DIR):
        return "a checkpoint"
    if (path / CKPT_DIR).is_dir() or (path / LOCK_FILE).exists() or (path / "metrics.jsonl").is_file():
        return "a run directory"
    if path.name == CKPT_DIR and any(path.glob("step_*")):
        return "a run's checkpoints folder"
    if (path / INDEX).is_file():
        return "a prepared dataset"
    return None


def check_out(out: str | Path, overwrite: bool) -> Path:
    """The real directory --out names, refused (ConfigError naming it and the fix) when it must not be written."""
    final = Path(os.path.realpath(out))
    for above in final.parents:
        if (above / STATE).is_file():
            raise ConfigError(f"--out {out} is inside the checkpoint {above}: an export never writes into one; "
                              "give another --out")
    if os.path.lexists(final) and not final.is_dir():
        raise ConfigError(f"--out {out} is a file: give a directory")
    # Found here, not after minutes of reading a large checkpoint, and not as the write's bare "File exists".
    blocked = next((p for p in final.parents if os.path.lexists(p) and not p.is_dir()), None)
    if blocked is not None:
        raise ConfigError(f"--out {out}: {blocked} is a file, so no directory can be made under it; give another --out")
    remove_leftovers(final)  # a killed export's scratch directory inside an empty --out
    what = _what(final) if final.is_dir() else None
    if what is not None:
        raise ConfigError(f"--out {out} is {what}: an export never replaces one (even with --overwrite); give a "
                          "new or empty --out")
    if final.is_dir() and any(final.iterdir()):
        if not overwrite:
            raise ConfigError(f"--out {out} exists and is not empty: pass --overwrite to replace it (a previous "
                              "export), or give a new --out")
        _refuse_non_export(out, final)
    _check_writable(out, final)
    return final


def _check_writable(out: str | Path, final: Path) -> None:
    """Where the export is built (swap.building: inside an empty --out, else beside it, making its parents) can be
    written: a read-only one failed only once the whole checkpoint had been read and verified."""
    empty = final.is_dir() and not any(final.iterdir())
    where = final if empty else next(p for p in final.parents if p.is_dir())
    try:
        os.rmdir(tempfile.mkdtemp(dir=where, prefix=".shardlm-write-test-"))
    except OSError as e:
        raise ConfigError(f"--out {out} cannot be written: {e.strerror or e}") from None


EXPORT_MARKS = ("config.json", "adapter_config.json")  # what write_hf_dir and write_peft_dir always write


def _refuse_non_export(out: str | Path, final: Path) -> None:
    """--overwrite deletes --out's contents: only a previous export's (files, one of EXPORT_MARKS among them),
    never a directory holding folders (a project, a home directory, the run being exported) or other files."""
    entries = sorted(final.iterdir())
    folders = [e.name + "/" for e in entries if e.is_dir() and not e.is_symlink()]
    if folders or not any((final / m).is_file() for m in EXPORT_MARKS):
        named = folders or [e.name for e in entries]
        shown = ", ".join(named[:3]) + (", ..." if len(named) > 3 else "")
        raise ConfigError(f"--out {out} is not a previous export (it holds {shown}): --overwrite replaces only "
                          "one (files, with config.json or adapter_config.json), since everything in --out is "
                          "deleted; give a new or empty --out")


@contextmanager
def writing(out: str | Path, overwrite: bool):
    """A scratch directory to write the export into; it becomes --out only when the block ends without error."""
    final = check_out(out, overwrite)
    with building(final) as scratch:
        yield scratch
        # safetensors' save_file makes its file 0600: the weights of a shared export were its owner's alone
        mask = os.umask(0)
        os.umask(mask)
        for path in scratch.iterdir():
            if path.is_file() and not path.is_symlink():
                os.chmod(path, 0o666 & ~mask)


def refuse_replacing_base(out: str | Path, base: str | None) -> None:
    """An adapter export into its run's train.init_from: that HF directory looks like a previous export, and
    --overwrite deleted the base model the adapter names."""
    if base and os.path.realpath(out) == os.path.realpath(base):
        raise ConfigError(f"--out {out} is this run's train.init_from, the base model its adapter applies to: an "
                          "adapter export never replaces it; give another --out (or --merge for a model that stands "
                          "alone)")


def refuse_beyond_fp16(state: dict, out: str) -> None:
    """fp16 holds up to 65504: a weight beyond it would be written as inf."""
    import torch
    limit = torch.finfo(torch.float16).max
    bad = next((n for n, w in state.items() if bool(w.abs().gt(limit).any())), None)
    if bad is not None:
        raise ConfigError(f"--dtype fp16: {bad} holds values beyond fp16's range (65504), which would be written to "
                          f"{out} as inf: export as bf16 or fp32")


def export_run(checkpoint: str, out: str, *, dtype: str, merge: bool, overwrite: bool, bar) -> str:
    """`shardlm export`: a run's checkpoint as a Hugging Face directory, or a LoRA run's adapter in PEFT's format
    (`merge` folds it into the weights instead). `bar(what, unit)` opens a progress bar; returns what was done."""
    from .adapter_check import ADAPTER_KEY, MERGED_KEY, adapter_fingerprint
    from .checkpoint import load_checkpoint
    from .config import RunError, config_from_dict
    from .data.instruct import turn_end_id
    from .generation_config import own_generation_config, with_eos, write_generation_config
    from .hf_config import changed_from_base
    from .model.hf import write_hf_dir
    from .parallel.lora import merged, peft_state, write_peft_dir
    from .precision import DTYPES
    from .tokenizer import load_tokenizer
    check_out(out, overwrite)  # before reading a large checkpoint
    # A 7B run is minutes of checksumming (its optimizer state too), then of writing: each has its bar.
    ckpt = load_checkpoint(checkpoint, with_optimizer=False, progress=bar("verify", "B"))
    full = config_from_dict(ckpt["state"]["config"])
    cfg, lora = full.model, full.lora
    if merge and not lora.rank:
        raise ConfigError(f"--merge: {ckpt['path']} is not a LoRA run (lora.rank = 0): it has no adapters to merge")
    base = full.train.init_from or None
    adapter = bool(lora.rank) and not merge
    if adapter:
        refuse_replacing_base(out, base)
        if base and (changed := changed_from_base(cfg, base)):
            raise ConfigError(f"{ckpt['path']}: " + "; ".join(changed) + ": a PEFT adapter is applied with its "
                              "base's config.json, under which this run's adapters compute another model; "
                              "export --merge for the model it trained")
    state, mark = ckpt["model"], {}
    if lora.rank:  # both exports of one run carry its adapters' fingerprint: --adapter refuses the pair
        mark = {(MERGED_KEY if merge else ADAPTER_KEY): adapter_fingerprint(state)}
    state = merged(state, cfg, lora) if merge else state
    if dtype == "fp16":  # what is written: an adapter export leaves the frozen base out
        refuse_beyond_fp16(peft_state(state, cfg) if adapter else state, out)
    tok = load_tokenizer(ckpt["path"])
    try:
        with writing(out, overwrite) as scratch:
            if adapter:
                write_peft_dir(state, cfg, lora, scratch, dtype=DTYPES[dtype], base=base, metadata=mark)
                # The run's tokenizer beside it, as a Trainer's save_model writes it: its chat template may be
                # the data's (data prepare writes one where the base has none), which the base lacks.
                tok.save(scratch)
                if generation := own_generation_config(ckpt["path"]):  # its stop ids, beside that tokenizer
                    write_generation_config(scratch, with_eos(generation, tok.eos_id, turn_end_id(tok)))
            else:
                # the generation_config.json the run kept from its weights' source, else one from config.json
                write_hf_dir(state, cfg, scratch, tok, dtype=DTYPES[dtype], metadata=mark,
                             generation_config=own_generation_config(ckpt["path"]), stops=(turn_end_id(tok),),
                             progress=bar("export", "parameters"))
    except OSError as e:
        raise RunError(f"writing {out} failed ({e.strerror or e}); it is as it was before the export") from None
    if not adapter:
        return f"exported {ckpt['path']} -> {out}"
    # Without train.init_from the adapter's base is the run's random start, which no other export writes.
    how = ("PEFT format; --merge for the merged model" if base
           else "PEFT format, of this run's random base, no train.init_from: only --merge writes that")
    if lora.quantize == "nf4":  # QLoRA's adapters fit the base as NF4 rounds it; --merge folds them into that
        how += ("; fitted to the base quantised to NF4: load the base in 4-bit NF4 (bitsandbytes' load_in_4bit) "
                "for the numbers it trained with")
    return f"exported the LoRA adapter of {ckpt['path']} -> {out} ({how})"
