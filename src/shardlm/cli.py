"""The `shardlm` command: train, eval, generate, serve, data prepare, export, plan. `shardlm train [CONFIG]
[--section.key value ...] [--out DIR] [--resume DIR] [--print-config]` runs under plain Python or torchrun
(`torchrun --nproc-per-node N -m shardlm train ...`)."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from contextlib import ExitStack
from pathlib import Path

from .config import SECTIONS, ConfigError, RunError, load_config, parse_overrides, preset_names, validate
from .config.load import refuse_empty_paths, refuse_misplaced_train_args
from .runtime.console import hide_compiler_notes, silence_stdout

TRAIN_EPILOG = f"""\
Any config key can be overridden as --section.key value (sections: {', '.join(SECTIONS)}),
for example --train.steps 100 --train.precision bf16. Use --print-config to see them all.
"""


def _train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardlm train", description="Train a model.", epilog=TRAIN_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", default=None,
                   help=f"a TOML file or a preset ({', '.join(preset_names())}); default: the embedded default")
    p.add_argument("--out", default=None, help="run directory for metrics.jsonl, TensorBoard and checkpoints "
                                               "(default: runs/<config name>)")
    p.add_argument("--resume", default=None, help="a run directory (its latest complete checkpoint) or a checkpoint")
    p.add_argument("--overwrite", action="store_true", help="train into an --out that holds another run's "
                                                            "checkpoints, deleting them and its metrics")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")
    return p


def _split_train_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Our own flags and the config name for argparse; every --section.key [value] for parse_overrides.

    argparse alone cannot do this: with an optional positional it takes the value of an unknown
    `--train.steps 50` as the config name."""
    ours, overrides, i = [], [], 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--") and "." in a.split("=", 1)[0]:
            following = argv[i + 1] if i + 1 < len(argv) else "--"
            # A flag where the value belongs is not the value: parse_overrides says the value is missing.
            take = 1 if "=" in a or following.startswith("--") else 2
            overrides += argv[i:i + take]
            i += take
        else:
            ours.append(a)
            i += 1
    return ours, overrides


def cmd_train(argv: list[str]) -> int:
    parser = _train_parser()
    ours, rest = _split_train_args(argv)
    refuse_misplaced_train_args(ours)
    args = parser.parse_args(ours)
    if args.config == "":  # as from an unset shell variable: it would have trained the default without a word
        raise ConfigError("the config is empty: give a TOML file or a preset, or leave it out for the default")
    overrides = parse_overrides(rest)
    if args.resume and args.config is None:
        # Resuming a run without naming its config continues with the config it was saved with.
        from .checkpoint import read_state
        from .config import apply_overrides, config_from_dict
        cfg = config_from_dict(read_state(args.resume)["config"], f"the config saved in {args.resume}")
        apply_overrides(cfg, overrides)
    else:
        from .config.load import own_model_keys
        from .hf_config import with_init_from
        cfg = load_config(args.config, overrides)
        cfg = with_init_from(cfg, {**own_model_keys(args.config), **overrides} if cfg.train.init_from else overrides)
    if args.print_config:
        validate(cfg, world_size=cfg.parallel.world)  # the layout's own world size: torchrun is not needed here
        print(cfg.to_toml())
        return 0
    from .runtime.launch_env import check_rendezvous_env, world_from_env
    from .runtime.heartbeat import Heartbeat, ranks_named
    from .runtime.watchdog import peer_failure
    out = args.out or _run_dir_of(args.resume) or str(Path("runs") / Path(args.config or "default").stem)
    if (world := world_from_env()[0]) > 1:  # torchrun's variables set by hand: named before the heartbeat reads them
        check_rendezvous_env(world)
    heartbeat = Heartbeat.from_env()
    try:
        return _train(cfg, out, args.resume, args.overwrite)
    except RunError:
        _farewell(heartbeat)
        raise
    except RuntimeError as e:
        why = peer_failure(e)
        if why is not None:
            # torchrun sends SIGTERM to every worker once one has failed: it must not cut this message short.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            if heartbeat is not None:
                heartbeat.gave_up()  # first: peers noticing this rank gone must not blame it
            failed = heartbeat.failed() if heartbeat is not None else []
            # Through the error file too: this rank, out first, is often what torchrun's summary calls the root cause.
            if failed:  # not a death: a peer's own error, which its message names
                said = heartbeat.unprinted(failed)
                why = f": {said[0]}" if said else " (its message says why)"
                _error(f"shardlm train: error: stopping: {ranks_named(failed)} stopped on an error{why}", 1, True)
            else:
                who = heartbeat.report() if heartbeat is not None else "which one could not be told"
                timeout = f"parallel.timeout_s = {cfg.parallel.timeout_s:g} s"
                if who.startswith("no rank died"):  # every peer beats on: where each one was, last
                    _error(f"shardlm train: error: a peer rank stalled ({why}; {timeout}): {who}", 1, True)
                else:
                    _error(f"shardlm train: error: a peer rank died or stalled: {who} ({why}; {timeout})", 1, True)
            if heartbeat is not None:
                heartbeat.close(wait=False)  # os._exit runs no interpreter shutdown for its thread to outlive
            _exit_now(1)
        _farewell(heartbeat)
        if "out of memory" in str(e) or "can't allocate memory" in str(e):
            t = cfg.train  # a step's activations grow with both: either may be what does not fit
            return _error(f"shardlm train: error: out of memory ({str(e).strip().splitlines()[0][:300]}): lower "
                          f"train.seq_len ({t.seq_len:,}) or train.micro_batch_size ({t.micro_batch_size}), recompute "
                          "(train.recompute full), or shrink or shard the model (parallel.zero_stage, parallel.tp, "
                          "parallel.cp)", 1, every_rank=True)
        raise
    except Exception as e:
        # Bad input is printed by a node's first rank alone (main): one rank's alone would go unsaid.
        _farewell(heartbeat, str(e) if isinstance(e, QUIET) and not _prints_bad_input() else "")
        raise
    finally:
        if heartbeat is not None:
            heartbeat.close()


def _farewell(heartbeat, unprinted: str = "") -> None:
    """This rank stops on its own error: its peers, whose next collective fails, say so instead of a death (and
    print its message where this rank does not: `unprinted`)."""
    if heartbeat is not None:
        heartbeat.farewell(unprinted)


def _run_dir_of(resume: str | None) -> str | None:
    """Where a resumed run writes by default: its own run directory, also when a checkpoint of it is named."""
    if resume is None:
        return None
    path = Path(resume)
    return str(path.parent.parent) if path.parent.name == "checkpoints" and "step_" in path.name else resume


def _train(cfg, out: str, resume: str | None, overwrite: bool) -> int:
    from .runtime.run_header import run_header
    from .trainer import Trainer
    trainer = Trainer(cfg, out_dir=out, resume=resume, overwrite=overwrite)
    # A resume at or past train.steps has said it has nothing to do: a header would claim steps that never run.
    if trainer.mesh.is_main and trainer.step < cfg.train.steps:
        print(run_header(cfg, trainer, out), flush=True)
    trainer.run()
    trainer.close()
    # A run stopped by a signal (and saved) did not finish: exit as one the signal ended does.
    return 128 + trainer.stopped_by if trainer.stopped_by else 0


def cmd_eval(argv: list[str]) -> int:
    from .inference.commands import cmd_eval as run
    return _unless_peers_fail("eval", run, argv)


def cmd_generate(argv: list[str]) -> int:
    from .inference.commands import cmd_generate as run
    return _unless_peers_fail("generate", run, argv)


def cmd_serve(argv: list[str]) -> int:
    from .serve.command import cmd_serve as run
    return _unless_peers_fail("serve", run, argv)


def _unless_peers_fail(cmd: str, run, argv: list[str]) -> int:
    """`run(argv)`; under --tp, a collective (or the rendezvous) that failed because a peer rank died or stalled
    stops this rank with one line and status 1: every surviving rank printed gloo's traceback of the engine's
    step, which named neither the cause nor the rank to read."""
    from .runtime.watchdog import peer_failure
    try:
        return run(argv)
    except RuntimeError as e:
        why = peer_failure(e)
        if why is None:
            raise
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # torchrun stops the survivors: not before this line is out
        _error(f"shardlm {cmd}: error: a peer rank died or stalled ({why}): the first rank to stop says why (torchrun's "
               "summary names it)", 1, every_rank=True)
        _exit_now(1)


def _exit_now(code: int) -> None:
    """Leave with `code`, what was printed flushed: a broken process group cannot be torn down, and left to
    interpreter shutdown its gloo threads abort the process (pytorch#190489)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cmd_data(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="shardlm data", description="Data preparation.")
    sub = p.add_subparsers(dest="action", required=True)
    prep = sub.add_parser("prepare", help="tokenize .txt/.jsonl/.parquet into memory-mapped token shards")
    prep.add_argument("--input", nargs="+", required=True, help="input files (.txt, .jsonl, .parquet)")
    prep.add_argument("--tokenizer", required=True, help="'byte', a tokenizer.json, or a directory holding one")
    prep.add_argument("--out", required=True)
    prep.add_argument("--text-field", default=None,
                      help="the jsonl field / parquet column holding the text (default: text)")
    prep.add_argument("--shard-tokens", default=str(1 << 27), help="tokens per shard file (1024 to 2^40)")
    prep.add_argument("--pad-to", type=int, default=None,
                      help="instruction examples: one per window of this train.seq_len (cut or padded, never "
                           "packed together); default: packed one after another")
    a = p.parse_args(argv)
    from .data.prepare import prepare, token_count
    index = prepare(a.input, a.tokenizer, a.out, shard_tokens=token_count(a.shard_tokens, "--shard-tokens"),
                    text_field=a.text_field, pad_to=a.pad_to)
    if "loss_mask" in index:
        cut = f", {index['truncated']:,} cut to --pad-to" if index["truncated"] else ""
        if index["untrained_examples"]:  # the loss of a step made of these alone would be 0, and train nothing
            cut += f", {index['untrained_examples']:,} with no token to train on"
        if index.get("empty_answers"):  # trained only to stop: most often data converted from the wrong field
            cut += f", {index['empty_answers']:,} with an empty answer (the first: {index['first_empty_answer']})"
        print(f"{index['examples']:,} instruction examples, {index['total_tokens']:,} tokens of which "
              f"{index['trained_tokens']:,} trained on{cut}, in {len(index['shards'])} shard(s) -> {a.out}")
        if index.get("plain_chat_examples"):
            print(f"note: {a.tokenizer} has no chat template: {index['plain_chat_examples']:,} conversations were "
                  "rendered as '<|role|>\\ncontent\\n' turns, and that format is written into the dataset "
                  "tokenizer's chat_template, which the run's export and `serve` take; for another format, put its "
                  "template in the tokenizer's tokenizer_config.json and prepare again", file=sys.stderr)
        return 0
    docs = index["documents"]
    empty = f" ({index['empty_documents']:,} empty skipped)" if index["empty_documents"] else ""
    print(f"{index['total_tokens']:,} tokens from {docs:,} document{'' if docs == 1 else 's'}{empty} in "
          f"{len(index['shards'])} shard(s) ({index['dtype']}, vocab {index['vocab_size']}) -> {a.out}")
    return 0


def cmd_export(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="shardlm export",
                                description="Write a Hugging Face directory (config.json, model.safetensors, "
                                            "tokenizer) from a shardlm run or checkpoint.")
    p.add_argument("--checkpoint", required=True, help="a run directory (its latest checkpoint) or a checkpoint")
    p.add_argument("--out", required=True, help="a new or empty directory (never a checkpoint, run or dataset)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--merge", action="store_true",
                   help="a LoRA run: fold the adapters into the weights and write the plain model "
                        "(default: the adapter alone, in PEFT's format)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (a previous export)")
    a = p.parse_args(argv)
    from .export import export_run
    with ExitStack() as bars:  # closed before an error propagates, so the error is the last line printed
        done = export_run(a.checkpoint, a.out, dtype=a.dtype, merge=a.merge, overwrite=a.overwrite,
                          bar=lambda what, unit: _bar(bars, what, unit))
    print(done)
    return 0


def _bar(bars: ExitStack, what: str, unit: str):
    """A `progress` for verify_checkpoint and write_hf_dir (runtime/progress.py), opened once its total is known
    and closed with `bars` or by the next one."""
    from .runtime.progress import progress

    def start(total: int):
        bars.close()  # one bar at a time: an open one would be redrawn below the next
        return bars.enter_context(progress(total, what, unit, scale=True)).update
    return start


def cmd_plan(argv: list[str]) -> int:
    from .plan.cli import run
    return run(argv)


COMMANDS = {"plan": cmd_plan, "train": cmd_train, "eval": cmd_eval, "generate": cmd_generate, "serve": cmd_serve,
            "data": cmd_data, "export": cmd_export}


def _error(message: str, code: int, every_rank: bool) -> int:
    """Say why the command stops; `code`. Under torchrun the message also goes to the worker's error file (its summary's
    root cause), and bad input, alike on every rank, is printed by a node's first rank alone (else by each rank)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        import json
        import time
        try:
            with open(path, "w") as f:
                json.dump({"message": {"message": message, "extraInfo": {"py_callstack": message,
                                                                         "timestamp": str(int(time.time()))}}}, f)
        except OSError:
            pass  # the summary then points at torchrun's docs, as without this file: the message is printed below
    if every_rank or _prints_bad_input():
        print(message, file=sys.stderr)
    return code


QUIET = (ConfigError, FileNotFoundError, ValueError)  # bad input: main prints it on a node's first rank alone


def _prints_bad_input() -> bool:
    """Whether this rank prints bad input (QUIET): a node's first rank under torchrun, whose error file carries it."""
    return not os.environ.get("TORCHELASTIC_ERROR_FILE") or os.environ.get("LOCAL_RANK", "0") == "0"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    hide_compiler_notes()
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: shardlm {train,eval,generate,serve,data,export,plan} ... | shardlm --version\n\n"
              "  train     train a model (default: the embedded default on the stdlib's sources)\n"
              "  eval      perplexity on a text file, or BLEU/chrF/ROUGE of generated completions\n"
              "  generate  sample from a model\n"
              "  serve     an OpenAI-compatible HTTP API over a model (and LoRA adapters), many clients at once\n"
              "  data      prepare token shards (data prepare --help)\n"
              "  export    write a Hugging Face checkpoint directory\n"
              "  plan      predict memory, time and communication of a layout, or search the best one\n\n"
              "Each has --help.")
        return 0
    if argv[0] == "--version":
        from importlib.metadata import PackageNotFoundError, version
        try:
            print(f"shardlm {version('shardlm')}")
        except PackageNotFoundError:  # run from a source tree that pip has not installed
            from . import __version__
            print(f"shardlm {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"shardlm: unknown command {cmd!r} (train, eval, generate, serve, data, export, plan)", file=sys.stderr)
        return 2
    previous = None
    if cmd in ("data", "export") and threading.current_thread() is threading.main_thread():
        # A scheduler's or a shell's SIGTERM ends them as Ctrl-C does: their partial output removed, one line.
        previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        refuse_empty_paths(rest)
        return COMMANDS[cmd](rest)
    except QUIET as e:
        return _error(f"shardlm {cmd}: error: {e}", 2, every_rank=False)
    except RunError as e:
        return _error(f"shardlm {cmd}: error: {e}", 1, every_rank=True)
    except BrokenPipeError:  # stdout's reader left (`shardlm plan ... | head`): end quietly, as a shell command
        silence_stdout()
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt as e:
        # Ctrl-C outside the training loop (which stops at a step's end and saves) or a second one inside it:
        # what the command writes is swapped in whole or kept line by line, so the traceback would say nothing.
        how = signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT
        print(f"\nshardlm {cmd}: interrupted ({'SIGTERM' if how == signal.SIGTERM else 'Ctrl-C'})", file=sys.stderr)
        return 128 + how
    finally:
        if previous is not None:  # main() may run inside another program (the tests call it in-process)
            signal.signal(signal.SIGTERM, previous)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is, to unwind it as Ctrl-C does."""


def _terminated(signum, frame):
    raise Terminated


if __name__ == "__main__":
    sys.exit(main())
