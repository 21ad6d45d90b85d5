"""`shardlm generate` and `shardlm eval`: a prompt or a jsonl file of them through the engine, and
perplexity or BLEU/chrF/ROUGE of a model's completions."""
from __future__ import annotations

import argparse
import json
import math
import os
from datetime import timedelta
from pathlib import Path

from ..config import ConfigError, RunError
from ..config.input_files import input_file
from ..config.load import refuse_non_utf8
from ..runtime.progress import progress
from .output_file import generate_file
from .request_lines import INT64, check_output, check_room, check_same_read, check_vocab, read_requests

COMPILE = {"auto": None, "on": True, "off": False}  # --compile: Engine's compile
TIMEOUT_S = 600.0  # --tp: the longest a rank waits for its peers, at the rendezvous and in any collective

EVAL_EPILOG = """\
tasks:
  loss   (default) mean next-token loss and perplexity over a UTF-8 text file, in non-overlapping
         windows of --seq-len tokens, every position but the last predicting the next token (the text's
         last tokens, fewer than a window, are not scored; "tokens" counts the predictions scored)
  bleu   corpus BLEU and chrF (sacrebleu) of completions generated for a jsonl file of
         {"prompt": ..., "completion": ...} lines ("reference" is accepted for "completion")
  rouge  mean ROUGE-1/2/L F1 (rouge-score, stemmed) of the same completions

bleu and rouge generate up to --max-new-tokens tokens per prompt (stopping at the tokenizer's end-of-text
token), greedy unless --temperature is set, up to --batch-size prompts at once of any lengths (continuous
batching); all scores are 0-100. They need pip install 'shardlm[eval]' (sacrebleu, rouge-score).
"""

GENERATE_EPILOG = """\
--input: one JSON object per line with "prompt" (a string) and optionally "max_new_tokens", "temperature",
"top_k", "top_p", "seed" and "stop" (a string or a list of them), which override the flags for that line, and
"id"; "completion" and "reference" (eval's files) are allowed and unused. Any other key is refused.
--output gets one object per input line, in order, as soon as it and every line before it are done:
{"prompt", "completion", "finish_reason" ("stop" or "length"), "prompt_tokens", "completion_tokens"}, and
"id" where the input line has one. Without --seed in a line, line i samples with seed --seed + i.
"""


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="an HF checkpoint directory, or a shardlm run or checkpoint")
    p.add_argument("--adapter", default=None, help="a PEFT LoRA adapter directory to apply to --model")
    runtime_args(p)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (torchrun --nproc-per-node N -m shardlm "
                   "... --tp N): each holds its slice of the weights; rank 0 writes the results")


def runtime_args(p: argparse.ArgumentParser) -> None:
    """How a loaded model runs: the flags generate, eval and serve share."""
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16", "fp16"),
                   help="auto: the checkpoint's 16-bit dtype on a GPU (bf16 for fp32 weights), fp32 on the CPU")
    p.add_argument("--compile", default="auto", choices=("auto", "on", "off"),
                   help="compile the decode step (auto: on a GPU, as CUDA graphs)")
    p.add_argument("--quantize", default="none", choices=("none", "int8", "int4"),
                   help="weight-only quantisation of the blocks' linear layers: int8 per channel, int4 per group "
                   "(the output head in int8 per channel for both)")


SAMPLING = {"max_new_tokens": 64, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0}  # the flags' defaults


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=SAMPLING["max_new_tokens"])
    p.add_argument("--temperature", type=float, default=SAMPLING["temperature"], help="0 is greedy")
    p.add_argument("--top-k", type=int, default=SAMPLING["top_k"])
    p.add_argument("--top-p", type=float, default=SAMPLING["top_p"])
    p.add_argument("--seed", type=int, default=SAMPLING["seed"])


def _refuse_unused(a, tasks: list[str]) -> None:
    """eval's flags of the other kind of task, which would be ignored without a word: the loss task generates
    nothing, and the text tasks score whole completions, not windows. The sampling flags default to None here."""
    if tasks == ["loss"]:
        given = next((k for k in SAMPLING if getattr(a, k) is not None), None)
        if given is not None:
            flag = "--" + given.replace("_", "-")
            raise ConfigError(f"{flag} has no effect on the loss task, which scores the text and generates nothing: "
                              f"leave it out, or give --tasks bleu,rouge with a jsonl of prompts")
    elif a.seq_len is not None:
        raise ConfigError(f"--seq-len has no effect on --tasks {','.join(tasks)}: it scores whole completions, not "
                          "windows; leave it out (it sets the loss task's windows)")
    for k, default in SAMPLING.items():
        if getattr(a, k) is None:
            setattr(a, k, default)


def _check_sampling(a) -> None:
    """Each sampling flag refused on its own, by name."""
    from .sampler import MAX_TEMPERATURE
    for flag, value, ok, rule in (
            ("--max-new-tokens", a.max_new_tokens, a.max_new_tokens >= 0, "must not be negative"),
            ("--temperature", a.temperature, 0 <= a.temperature <= MAX_TEMPERATURE,
             f"must be a finite number in [0, {MAX_TEMPERATURE:.4g}] (0 is greedy)"),
            ("--top-k", a.top_k, 0 <= a.top_k < INT64, "must not be negative (0: every token) and fit in 64 bits"),
            ("--top-p", a.top_p, 0 < a.top_p <= 1, "is in (0, 1]"),
            ("--seed", a.seed, -INT64 <= a.seed < INT64, "does not fit in 64 bits")):
        if not ok:
            raise ConfigError(f"{flag} {value} {rule}")


def _refuse_sampling_when_greedy(a) -> None:
    """--top-k and --top-p shape sampling, which --temperature 0 (the default) turns off: each given there was
    ignored without a word, the answer greedy where the user asked for a sample. (A --seed is let be: scripts pass
    one whatever the temperature, and it changes nothing where nothing is drawn.)"""
    if a.temperature == 0:
        for flag, key in (("--top-k", "top_k"), ("--top-p", "top_p")):
            if (value := getattr(a, key)) != SAMPLING[key]:
                raise ConfigError(f"{flag} {value} has no effect at --temperature 0, which decodes greedily: give "
                                  "--temperature above 0 to sample, or leave it out")


def check_world(tp: int) -> tuple[int, int, int]:
    """(world, rank, local rank) of a generate/eval/serve launch, refused where the processes started (torchrun's
    WORLD_SIZE, or one set by hand) are not --tp's: `torchrun --nproc-per-node 2 ... generate` without --tp would run
    the whole model in each process, each printing (or writing) every answer; each `serve` would race for the port."""
    from ..runtime.launch_env import world_from_env
    if tp < 1:  # else told to start `torchrun --nproc-per-node 0`
        raise ConfigError(f"--tp {tp} must be at least 1 (1: one process)")
    world, rank, local = world_from_env()
    if world != tp and tp == 1:
        raise ConfigError(f"this is one of {world} processes (WORLD_SIZE = {world}, as torchrun sets it) but --tp is "
                          f"1: each would run the whole model and repeat the same work; split the model with --tp "
                          f"{world}, or run one process, without torchrun (and unset WORLD_SIZE)")
    if world != tp:
        raise ConfigError(f"--tp {tp} runs as {tp} processes, one per rank: torchrun --nproc-per-node {tp} "
                          f"-m shardlm ... --tp {tp} (this is {world} process{'es' if world > 1 else ''})")
    return world, rank, local


def _tensor_parallel(a):
    """(device, tp group, whether this rank writes the results): one process, or one of --tp ranks that
    torchrun started (the process group initialised here unless the caller has one)."""
    from ..runtime.device import pick_device
    if a.tp > 1 and a.device.startswith("cuda:"):  # each rank's GPU is its local rank's: K would be ignored
        raise ConfigError(f"--device {a.device} with --tp {a.tp}: each rank takes the GPU of its local rank (the "
                          f"first {a.tp} visible); choose them by CUDA_VISIBLE_DEVICES, give --device cuda or none")
    world, rank, local = check_world(a.tp)
    device = pick_device(a.device, "--device")
    if a.tp == 1:
        return device, None, True
    import torch
    import torch.distributed as dist

    from ..mesh import build_mesh, check_same_settings, rendezvous
    from ..runtime.launch_env import check_rendezvous_env
    if a.quantize != "none":
        raise ConfigError("--quantize with --tp: the tensor-parallel linears are not quantised yet; give one of them")
    if device.type == "cuda":
        # Every rank checks the node's count, as train does: a rank without a GPU stopped on CUDA's 'invalid device
        # ordinal' traceback, and the others waited at the rendezvous for it.
        local_world, gpus = max(int(os.environ.get("LOCAL_WORLD_SIZE", 0)), local + 1), torch.cuda.device_count()
        if local_world > gpus:
            raise ConfigError(f"{local_world} processes on this node need one GPU each, but {gpus} "
                              f"{'is' if gpus == 1 else 'are'} visible: start at most {gpus} per node (torchrun "
                              f"--nproc-per-node {gpus}, --tp to match), or run on the CPU (--device cpu)")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        check_rendezvous_env(world)
        # torch's default waited 30 minutes in silence for a peer never started, or stopped before it (its own
        # flags refused, a rank started by hand with others): said after 10 s, and refused at TIMEOUT_S.
        timeout = timedelta(seconds=TIMEOUT_S)
        try:
            rendezvous("nccl" if device.type == "cuda" else "gloo", timeout, world, local == 0)
        except dist.DistError as e:
            raise RunError(f"the {world} ranks of --tp {a.tp} did not all join at {os.environ['MASTER_ADDR']}:"
                           f"{os.environ['MASTER_PORT']} within {timeout.total_seconds():g} s "
                           f"({(str(e).strip().splitlines() or [type(e).__name__])[0]}): start each, with the same "
                           f"MASTER_ADDR, MASTER_PORT and WORLD_SIZE (torchrun --nproc-per-node {a.tp} does)") from None
    # Every rank decodes the same requests (others aborted in gloo's C++, or decoded on with other tokens).
    check_same_settings({f"--{key.replace('_', '-')}": value for key, value in vars(a).items()})
    return device, build_mesh(tp=a.tp).group("tp"), rank == 0


def _load(a, read=None, source: str = "", chats: bool = False):
    """The model, tokenizer and config `a` asks for; under --tp, after refusing ranks whose file `source` held
    other contents (`read`: what this rank read from it). `chats`: `source` holds chats, which a tokenizer
    without a chat template is refused for before the weights load."""
    from .load import load_pretrained
    device, group, a.main = _tensor_parallel(a)
    if group is not None and read is not None:
        check_same_read(read, source)
    model, tok, cfg = load_pretrained(a.model, device=device, dtype=a.dtype, adapter=a.adapter, tp_group=group,
                                      check_tokenizer=(lambda tok: _chat_template(tok, source)) if chats else None,
                                      stall_s=TIMEOUT_S, quantize=a.quantize)
    return model, tok, cfg


def cmd_eval(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="shardlm eval", description="Evaluate a model: perplexity on a text file, "
                                "or BLEU/chrF/ROUGE of its completions of prompts against references.",
                                epilog=EVAL_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_args(p)
    p.add_argument("--data", required=True, help="a UTF-8 text file (loss), or a jsonl file (bleu, rouge)")
    p.add_argument("--tasks", default="loss", help="loss, or a comma-separated list of bleu and rouge")
    p.add_argument("--seq-len", type=int, default=None, help="window length of the loss task (required for it)")
    p.add_argument("--batch-size", type=int, default=8, help="windows (loss) or prompts decoded at once")
    _sampling_args(p)
    p.set_defaults(**dict.fromkeys(SAMPLING))  # told apart from not given: the loss task refuses them
    p.add_argument("--json", action="store_true", help='print {"loss", "perplexity", "tokens"} (null where not a '
                   'finite number), or the text tasks\' scores with "examples" and "completions"')
    a = p.parse_args(argv)
    from ..text_metrics import loss_text, parse_tasks, read_examples, require_scorers
    tasks = parse_tasks(a.tasks)
    _refuse_unused(a, tasks)
    if a.batch_size < 1:
        raise ConfigError(f"--batch-size {a.batch_size} must be at least 1")
    if tasks == ["loss"]:
        if a.seq_len is None:
            raise ConfigError("the loss task needs --seq-len N, the length of the windows it scores (the run's "
                              "train.seq_len, or any up to the model's max_seq_len)")
        input_file(Path(a.data), "--data")
        text = loss_text(Path(a.data))  # before loading the model: a bad file fails fast
    else:
        _check_sampling(a)
        _refuse_sampling_when_greedy(a)
        require_scorers(tasks)
        prompts, refs = read_examples(a.data, tasks)  # before loading the model: a bad file fails fast
        if a.seed + len(prompts) - 1 >= INT64:  # prompt i samples with seed --seed + i
            raise ConfigError(f"--seed {a.seed}: prompt i samples with --seed + i, and {a.seed} + "
                              f"{len(prompts) - 1} does not fit in 64 bits; give a lower --seed")
    model, tok, _ = _load(a, text if tasks == ["loss"] else (prompts, refs), f"--data {a.data}",
                          chats=tasks != ["loss"] and any(not isinstance(q, str) for q in prompts))
    if tasks == ["loss"]:
        from .perplexity import evaluate_ids
        ids = tok.encode_document(text)
        check_vocab(ids, model.cfg.vocab_size, f"--data {a.data}")
        bar = None
        def update(k):  # the bar opens with the first batch: a refused --seq-len prints its error line alone
            nonlocal bar
            bar = bar or progress(len(ids) // a.seq_len, "eval", "windows", a.main)
            bar.update(k)
        try:
            r = evaluate_ids(model, ids, a.seq_len, a.batch_size, update)
        finally:
            if bar is not None:
                bar.close()
        if a.main:
            # JSON has no infinity or NaN: a diverged model's loss (NaN logits) or a perplexity past a double's
            # range is written null
            strict = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in r.items()}
            print(json.dumps(strict) if a.json else f"loss {r['loss']:.4f} | perplexity {r['perplexity']:.3f} | "
                                               f"{r['tokens']:,} predicted tokens")
        return 0
    from ..data.instruct import completion_stop_ids
    from ..text_metrics import score
    from . import generate_many, prompt_ids
    ids = [prompt_ids(tok, q) if isinstance(q, str) else _chat_ids(tok, q, f"--data {a.data}: example {i + 1}")
           for i, q in enumerate(prompts)]
    for i, q in enumerate(ids):  # named with what to do, not as the engine's 'prompt i' once it has been built
        check_vocab(q, model.cfg.vocab_size, f"--data {a.data}: example {i + 1}")
        check_room(q, a.max_new_tokens, "--max-new-tokens", model.cfg.max_seq_len, f"--data {a.data}: example {i + 1}")
    with progress(len(prompts), "eval", "requests", a.main) as bar:
        new = generate_many(model, ids, a.max_new_tokens, completion_stop_ids(tok),
                            a.batch_size, a.temperature, a.top_k, a.top_p, a.seed, COMPILE[a.compile], bar.update,
                            vocab=tok.vocab_size)
    completions = [tok.text(ids) for ids in new]
    scores = score(completions, refs, tasks)
    if not a.main:
        return 0
    if a.json:
        print(json.dumps({**scores, "examples": len(prompts), "completions": completions}))
    else:
        print(f"{'metric':<8} {'score (0-100)':>13}")
        for name, value in scores.items():
            print(f"{name:<8} {value:>13.2f}")
        print(f"{len(prompts)} examples, up to {a.max_new_tokens} new tokens each")
    return 0


def _chat_template(tok, source: str):
    """The tokenizer's chat renderer; a ConfigError where it has no chat template."""
    from ..data.instruct import chat_prompter
    chat = chat_prompter(tok)
    if chat is None:
        raise ConfigError(f"{source} holds chats (messages) and the model's tokenizer has no chat template to "
                          "render them (chat_template.jinja or tokenizer_config.json's chat_template): give prompts")
    return chat


def _chat_ids(tok, turns: list[dict], source: str) -> list[int]:
    """A held-out chat's turns before its answer, rendered as training and serve render them."""
    from . import prompt_ids
    from ..data.instruct import InstructError
    chat = _chat_template(tok, source)
    import jinja2
    try:
        return prompt_ids(tok, chat(turns), opened=True)
    # a traceback, where data prepare names the line of a chat it fails on; the template's own raise_exception
    # (InstructError) named no line
    except (jinja2.TemplateError, InstructError) as e:
        raise ConfigError(f"{source}: the model's chat template fails on a conversation: {e}") from None


def cmd_generate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="shardlm generate", description="Continue a prompt, or every prompt of a "
                                "jsonl file, with a static KV cache and continuous batching.",
                                epilog=GENERATE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--input", help="a jsonl file of prompts (see below); needs --output")
    p.add_argument("--output", help="where --input's completions go (jsonl)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    _sampling_args(p)
    p.add_argument("--stop", action="append", default=[], help="a string that ends a completion (repeatable)")
    p.add_argument("--max-batch", type=int, default=32, help="requests decoded at once (fewer where the GPU's "
                                                              "free memory holds fewer)")
    p.add_argument("--json", action="store_true", help='print {"completion": ...} (--prompt)')
    a = p.parse_args(argv)
    _check_sampling(a)
    if "" in a.stop:  # it would end every completion before its first token
        raise ConfigError("--stop '': a stop must be a non-empty string")
    if a.max_batch < 1:
        raise ConfigError(f"--max-batch {a.max_batch} must be at least 1")
    for flag, text in [("--prompt", a.prompt or "")] + [("--stop", s) for s in a.stop]:
        refuse_non_utf8(flag, text, ", or put the prompt in an --input file")
    if a.input is not None:
        if a.output is None:
            raise ConfigError("--input needs --output, the jsonl file its completions go to")
        if a.json:
            raise ConfigError("--json goes with --prompt: --input's completions are written to --output as jsonl; "
                              "leave it out")
        rows = read_requests(Path(a.input), a)
        if all(r["sampling"].greedy for r in rows):  # no line samples: --top-k/--top-p would shape nothing
            for flag, key in (("--top-k", "top_k"), ("--top-p", "top_p")):
                if (value := getattr(a, key)) != SAMPLING[key]:
                    raise ConfigError(f"{flag} {value} has no effect: every --input line decodes greedily "
                                      "(temperature 0, its own or --temperature's); give --temperature above 0 "
                                      "(or a line's temperature) to sample, or leave it out")
        check_output(Path(a.output), Path(a.input), a.overwrite)
    else:
        if a.output is not None:
            raise ConfigError("--output goes with --input (a jsonl file of prompts); a --prompt's completion is "
                              "printed (--json for JSON)")
        if a.overwrite:
            raise ConfigError("--overwrite goes with --output (an --input file's completions); a --prompt's "
                              "completion is printed, nothing is written: leave it out")
        _refuse_sampling_when_greedy(a)  # an --input line may set its own temperature, which these then shape
        from .sampler import SamplingParams
        rows = [{"prompt": a.prompt, "id": None, "max_new": a.max_new_tokens, "stop": tuple(a.stop),
                 "sampling": SamplingParams(a.temperature, a.top_k, a.top_p, a.seed), "where": "--prompt",
                 "max_new_from": "--max-new-tokens"}]
    for r in rows:
        r["stop"] = r["stop"] or tuple(a.stop)
    model, tok, cfg = _load(a, rows if a.input is not None else None, f"--input {a.input}",
                            chats=any(r.get("messages") is not None for r in rows))
    from ..data.instruct import completion_stop_ids
    from . import Engine, Request, prompt_ids, slots_that_fit
    from ..parallel.tensor import tensor_parallel_group
    stop_ids = completion_stop_ids(tok)  # as serve's: end of text, generation_config.json's eos ids, end of turn
    asked = [prompt_ids(tok, r["prompt"]) if r.get("messages") is None else
             _chat_ids(tok, r["messages"], r["where"]) for r in rows]
    # A chat's answer is a turn of its own (its template places the space before it), as serve and eval decode it
    stops = [tok.split_stops(r["stop"]) for r in rows]
    requests = [Request(ids, r["max_new"], r["sampling"], stop_ids + special, strings, tag=i,
                        continues=r.get("messages") is None)
                for i, (ids, r, (strings, special)) in enumerate(zip(asked, rows, stops))]
    for r, row in zip(requests, rows):
        check_vocab(r.prompt, cfg.vocab_size, row["where"])
        check_room(r.prompt, r.max_new_tokens, row["max_new_from"], cfg.max_seq_len, row["where"])
    max_len = max(len(r.prompt) + r.max_new_tokens for r in requests)
    slots = slots_that_fit(model, max_len, min(a.max_batch, len(requests)), group=tensor_parallel_group(model),
                           shorter="shorten the longest prompt or its number of new tokens")
    engine = Engine(model, slots, max_len, compile=COMPILE[a.compile], decode=tok.text, vocab=tok.vocab_size)
    if a.input is None:
        (r,) = engine.run(requests)
        if a.main:
            print(json.dumps({"completion": r.text}) if a.json else a.prompt + r.text)
        return 0
    return generate_file(engine, requests, rows, Path(a.output), a.main)
