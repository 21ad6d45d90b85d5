"""Fine-tuning from a Hugging Face checkpoint (`train.init_from`): its config.json gives the model section, its
weights the start, under any layout, with or without LoRA."""
import json
import re

import numpy as np
import pytest
import torch

import dist_fns
from helpers import bracket_chat_tokenizer, cli_here, write_jsonl
from shardlm.config import IGNORE, ConfigError, load_config
from shardlm.hf_config import with_init_from
from shardlm.model import Decoder
from shardlm.model.hf import read_hf_dir, write_hf_dir
from shardlm.testing.distributed import run_distributed


def hf_dir(tmp_path, **model):
    """A random model of `tiny`'s family (with `model` changed) written as an HF directory."""
    cfg = load_config("tiny", {f"model.{k}": str(v) for k, v in model.items()})
    m = Decoder(cfg.model)
    m.init_weights(seed=7)
    with torch.no_grad():  # norms away from their initial ones, so that loading them is seen
        for name, p in m.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    write_hf_dir(m.state_dict(), cfg.model, tmp_path / "hf")
    return tmp_path / "hf", m.state_dict()


@pytest.mark.parametrize("layout", [{"parallel.dp": "1"}, {"parallel.tp": "2", "parallel.dp": "1"},
                                    {"parallel.pp": "2", "parallel.dp": "1"},
                                    {"parallel.dp": "2", "parallel.zero_stage": "3"}], ids=["one", "tp2", "pp2", "zero3"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_training_starts_from_the_checkpoints_weights(tmp_path, layout, lora):
    """With lr 0 the weights after a step are the checkpoint's, on every layout."""
    path, want = hf_dir(tmp_path)
    over = {"train.init_from": str(path), "train.lr": "0", "train.steps": "1", "train.warmup_steps": "0",
            "train.weight_decay": "0", **layout, **({"lora.rank": "4"} if lora else {})}
    world = int(layout.get("parallel.tp", 1)) * int(layout.get("parallel.pp", 1)) * int(layout["parallel.dp"])
    results = run_distributed(dist_fns.train_and_capture, world, over, timeout=240) if world > 1 else \
        [dist_fns.train_and_capture(0, 1, {**over, "train.device": "cpu"})]
    masters = next(r["masters"] for r in results if r["masters"] is not None)
    for name, value in want.items():
        torch.testing.assert_close(masters[name], value, rtol=0, atol=0, msg=name)


def test_a_resume_whose_config_names_no_base_keeps_the_runs(tmp_path, capsys):
    """A preset given beside --resume has no train.init_from: the run then recorded none, and its exported
    adapter named "this run's random base" as its base."""
    import json
    path, _ = hf_dir(tmp_path)
    cli_here(capsys, "train", "tiny", "--train.init_from", path, "--train.steps", "2", "--lora.rank", "4",
             "--out", tmp_path / "run")
    cli_here(capsys, "train", "tiny", "--resume", tmp_path / "run", "--train.steps", "3", "--lora.rank", "4")
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_00000003" / "state.json").read_text())
    assert state["config"]["train"]["init_from"] == str(path)


def test_the_model_section_comes_from_the_checkpoint(tmp_path, capsys):
    path, want = hf_dir(tmp_path, num_layers=3, hidden_size=48, num_heads=6, num_kv_heads=3)
    cfg = with_init_from(load_config("tiny", {"train.init_from": str(path), "model.max_seq_len": "64"}),
                         {"model.max_seq_len": "64"})
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.kv_heads, cfg.model.max_seq_len) == (3, 48, 3, 64)
    cli_here(capsys, "train", "tiny", "--train.init_from", path, "--train.steps", "2", "--lora.rank", "4",
             "--out", tmp_path / "run")
    state = read_hf_dir(path)[1]
    from shardlm.checkpoint import load_checkpoint
    saved = load_checkpoint(tmp_path / "run", with_optimizer=False)["model"]
    for name, value in state.items():  # the frozen base, as loaded
        assert torch.equal(saved[name], value), name


def test_a_missing_checkpoint_fails_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="train.init_from = .*nowhere.*config.json"):
        with_init_from(load_config("tiny", {"train.init_from": str(tmp_path / "nowhere")}))
    (tmp_path / "model.safetensors").write_bytes(b"")  # a file of the checkpoint, where its directory belongs
    with pytest.raises(ConfigError, match=re.escape(f"it is a file; give the directory holding it ({tmp_path})")):
        with_init_from(load_config("tiny", {"train.init_from": str(tmp_path / "model.safetensors")}))


# ---- instruction data ----------------------------------------------------------------------------------

def trained_text(out, pad_to=None):
    """(trained, untrained) bytes of a prepared byte-tokenizer dataset, end-of-text as '#'."""
    from shardlm.data.loader import TokenShards
    shards = TokenShards(out)
    ids = np.concatenate([np.asarray(t) for t in shards.tokens]).astype(np.int64)
    mask = np.concatenate([np.asarray(m) for m in shards.masks]).astype(bool)
    text = lambda sel: bytes(int(i) if i < 256 else ord("#") for i in ids[sel]).decode()  # noqa: E731
    return text(mask), text(~mask)


def test_prepare_masks_the_prompts_and_trains_the_answers(tmp_path):
    from shardlm.data.prepare import prepare
    data = write_jsonl(tmp_path / "a.jsonl", [
        {"prompt": "Q: 1+1?\n", "completion": "2"},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"},
                      {"role": "assistant", "content": "ciao"}]}])
    index = prepare([data], "byte", tmp_path / "out", progress=False)
    trained, untrained = trained_text(tmp_path / "out")
    assert trained == "2#hello\nciao\n#"  # answers and the end-of-text that closes each example
    assert untrained == "Q: 1+1?\n<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n<|user|>\nbye\n<|assistant|>\n"
    assert index["examples"] == 2 and index["trained_tokens"] == len(trained)


@pytest.mark.parametrize("bos", [False, True])
def test_chats_rendered_without_a_template_leave_that_format_as_the_datasets_chat_template(tmp_path, bos):
    """A tokenizer with no chat template: conversations are trained in the plain '<|role|>' format, which serve's
    chat endpoint and transformers' apply_chat_template of the export knew nothing of. The dataset's tokenizer now
    holds it as its template: preparing again through it gives the same tokens, its opening token (Llama's <s>) too."""
    from tokenizers.processors import TemplateProcessing

    from shardlm.data.instruct import chat_prompter
    from shardlm.data.prepare import prepare
    from shardlm.tokenizer import byte_tokenizer, load_tokenizer
    tok = byte_tokenizer()
    if bos:
        tok.add_special_tokens(["<s>"])
        tok.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": chat}, {"prompt": "a", "completion": "b"}])
    assert prepare([data], str(tmp_path / "tok"), tmp_path / "one", progress=False)["plain_chat_examples"] == 1
    settings = json.loads((tmp_path / "one" / "tokenizer_config.json").read_text())
    # written where there was none: with the end-of-text token that export writes into one it makes itself
    assert "chat_template" in settings and settings["eos_token"] == "<|endoftext|>"
    prepare([data], str(tmp_path / "one"), tmp_path / "two", progress=False)
    for name in ("shard_00000.bin", "mask_00000.bin"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    served = chat_prompter(load_tokenizer(tmp_path / "one"))(chat[:1])
    assert served == ("<s>" if bos else "") + "<|user|>\nhi\n<|assistant|>\n"


def test_a_generation_prompt_that_opens_more_than_a_finished_answer_masks_the_answer_after_the_common_part(tmp_path):
    """DeepSeek-R1-Distill's template prompts with "<｜Assistant｜><think>\\n" but renders a finished answer as
    "<｜Assistant｜>" + its text after any </think>: every conversation was refused as "renders turn 2 by rewriting
    the turns before it", which it does not. The answer is trained from where the two part."""
    from shardlm.data.prepare import prepare
    tok_dir = bracket_chat_tokenizer(tmp_path / "tok")
    template = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ '[user]' + m['content'] }}{% else %}"
                "{% set c = m['content'] %}{% if '</think>' in c %}{% set c = c.split('</think>')[-1] %}{% endif %}"
                "{{ '[assistant]' + c + eos_token }}{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}{{ '[assistant]<think>\\n' }}{% endif %}")
    settings = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({**settings, "chat_template": template}))
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>\nx\n</think>yo"},
        {"role": "user", "content": "and?"}, {"role": "assistant", "content": "<b>ok</b>"}]}])
    prepare([data], str(tok_dir), tmp_path / "out", progress=False)
    assert trained_text(tmp_path / "out") == ("yo#<b>ok</b>#", "[user]hi[assistant][user]and?[assistant]")
    # a template that does rewrite earlier turns (each numbered from the last) is still refused
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({**settings, "chat_template": template.replace(
        "'[user]'", "'[user' + loop.revindex|string + ']'")}))
    from shardlm.data.prepare import PrepareError
    with pytest.raises(PrepareError, match="renders turn 2 by rewriting the turns before it"):
        prepare([data], str(tok_dir), tmp_path / "again", progress=False)


def test_prepare_renders_chat_with_the_tokenizers_template(tmp_path):
    from shardlm.data.prepare import prepare
    tok_dir = bracket_chat_tokenizer(tmp_path / "tok")
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                            {"role": "assistant", "content": "yo"}]}])
    index = prepare([data], str(tok_dir), tmp_path / "out", progress=False)
    trained, untrained = trained_text(tmp_path / "out")
    assert (trained, untrained) == ("yo#", "[user]hi#[assistant]")  # the template's own end-of-text closes it
    # Its end-of-text closes the user's turn too: packed examples could not be told apart by it.
    from shardlm.data.loader import DataError, TokenShards, WindowDataset
    assert index["eos_inside_examples"] == 1
    with pytest.raises(DataError, match="prepare it with --pad-to 8"):
        WindowDataset(TokenShards(tmp_path / "out"), 8)
    prepare([data], str(tok_dir), tmp_path / "out", pad_to=24, progress=False)  # into the same directory
    assert len(WindowDataset(TokenShards(tmp_path / "out"), 24)) == 1


def test_an_end_of_text_spelled_out_in_a_prompt_is_named_as_a_cause_when_packing(tmp_path):
    """No chat template here: the error blamed one, and the user's text holding the token's spelling was the cause."""
    from shardlm.data.loader import DataError, TokenShards, WindowDataset
    from shardlm.data.prepare import prepare
    tok_dir = tmp_path / "tok"
    load_tokenizer_byte_with_eos(tok_dir)
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a <|endoftext|> b", "completion": "c"}])
    assert prepare([data], str(tok_dir), tmp_path / "out", progress=False)["eos_inside_examples"] == 1
    with pytest.raises(DataError, match="or a prompt or answer that spells the token out.*--pad-to 8"):
        WindowDataset(TokenShards(tmp_path / "out"), 8)


def test_instruction_data_under_a_tokenizer_with_no_end_of_text_says_where_to_name_one(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from shardlm.data.prepare import PrepareError, prepare
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "completion": "b"}])
    with pytest.raises(PrepareError, match="end-of-text token.*tok has none: set tokenizer_config.json's eos_token"):
        prepare([data], str(tmp_path / "tok"), tmp_path / "out", progress=False)


def load_tokenizer_byte_with_eos(tok_dir):
    from shardlm.tokenizer import load_tokenizer
    load_tokenizer("byte").save(tok_dir)
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def test_pad_to_gives_one_example_per_window(tmp_path):
    from shardlm.data.loader import DataError, TokenShards, WindowDataset
    from shardlm.data.prepare import prepare
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ab", "completion": "cd"},
                                              {"prompt": "x" * 30, "completion": "y" * 30}])
    index = prepare([data], "byte", tmp_path / "out", pad_to=16, progress=False)
    assert index["truncated"] == 1
    windows = WindowDataset(TokenShards(tmp_path / "out"), 16)
    assert len(windows) == 2
    x, y = windows.pairs([0, 1])
    assert bytes(x[0, :4].tolist()).decode() == "abcd" and y[0].tolist()[:5] == [-100, ord("c"), ord("d"), 256, -100]
    assert (y[0, 4:] == -100).all()  # the padding trains nothing
    with pytest.raises(DataError, match="--pad-to 32"):
        WindowDataset(TokenShards(tmp_path / "out"), 32)


def sft_data(tmp_path, n=64):
    from shardlm.data.prepare import prepare
    rng = np.random.default_rng(0)
    words = ["apple", "river", "stone", "cloud", "tiger", "lamp"]
    records = [{"prompt": f"reverse {' '.join(w)}:", "completion": " ".join(reversed(w))}
               for w in (rng.choice(words, size=int(rng.integers(1, 4))).tolist() for _ in range(n))]
    prepare([write_jsonl(tmp_path / "sft.jsonl", records)], "byte", tmp_path / "sft", progress=False)
    return str(tmp_path / "sft")


def test_the_loss_is_the_mean_over_the_global_batchs_trained_targets(tmp_path):
    """Micro-batches hold unequal numbers of trained targets: the step's loss is their sum over all of them
    divided by their count, not a mean of the micro-batches' means."""
    import torch.nn.functional as F
    trainer = dist_fns.tiny_trainer(1, {"data.path": sft_data(tmp_path), "train.seq_len": "24",
                                        "train.micro_batch_size": "2", "train.global_batch_size": "8",
                                        "train.device": "cpu"})
    batches = [trainer.data.micro_batch_at(0, m) for m in range(4)]
    counts = [int((y != -100).sum()) for _, y in batches]
    assert len(set(counts)) > 1
    with torch.no_grad():
        summed = sum(F.cross_entropy(trainer.model(x).flatten(0, 1), y.flatten(), reduction="sum") for x, y in batches)
    torch.testing.assert_close(trainer.train_step(), summed / sum(counts), rtol=1e-6, atol=0)


GPT2 = {"model.arch": "gpt2", "model.num_kv_heads": "0"}  # learned positions: restarted per packed example too


@pytest.mark.parametrize("layout", [{"parallel.dp": "2"}, {"parallel.dp": "2", "parallel.zero_stage": "1"},
                                    {"parallel.pp": "2", "parallel.dp": "1", "train.micro_batch_size": "1"},
                                    {"parallel.tp": "2", "parallel.dp": "1"},
                                    {"parallel.tp": "2", "parallel.sp": "true", "parallel.dp": "1", **GPT2},
                                    {"parallel.cp": "2", "parallel.dp": "1"},
                                    {"parallel.cp": "2", "parallel.dp": "2", **GPT2},
                                    {"parallel.pp": "2", "parallel.cp": "2", "parallel.dp": "1",
                                     "train.micro_batch_size": "1"}],
                         ids=["dp2", "dp2-zero1", "pp2", "tp2", "tp2-sp-gpt2", "cp2", "dp2-cp2-gpt2", "pp2-cp2"])
def test_instruction_training_under_other_layouts_equals_one_process(tmp_path, layout):
    """Packed examples (document masks, per-example positions) and completion-only losses, any layout."""
    from test_tensor_parallel import OPTIMIZERS, check_equal
    over = {"data.path": sft_data(tmp_path), "train.seq_len": "24", "train.steps": "3", "train.micro_batch_size": "2",
            "train.global_batch_size": "8", **OPTIMIZERS["sgd"], "lora.rank": "4",
            **{k: v for k, v in layout.items() if k.startswith("model.")}}
    ref = dist_fns.train_and_capture(0, 1, {**over, "train.device": "cpu", "parallel.dp": "1"})
    world = 1
    for axis in ("dp", "pp", "tp", "cp"):
        world *= int(layout.get(f"parallel.{axis}", 1))
    check_equal(run_distributed(dist_fns.train_and_capture, world, {**over, **layout}, timeout=240), ref)


@pytest.mark.parametrize("model", [{}, GPT2], ids=["llama", "gpt2"])
def test_packed_examples_do_not_attend_across_their_boundary(model):
    """The logits of examples packed into one window equal each example's alone."""
    cfg = load_config("tiny", model)
    m = Decoder(cfg.model)
    m.init_weights(0)
    eos = 5
    a, b, c = torch.tensor([[7, 8, 9, eos]]), torch.tensor([[11, 12, eos]]), torch.tensor([[13, 14, 15, 16]])
    with torch.no_grad():
        alone = [m(x) for x in (a, b, c)]
        m.doc_eos = eos
        packed = m(torch.cat([a, b, c], 1))
    torch.testing.assert_close(packed, torch.cat(alone, 1), rtol=1e-5, atol=1e-5)
    m.doc_eos = None
    with torch.no_grad():
        assert not torch.allclose(m(torch.cat([a, b, c], 1)), packed, atol=1e-3)  # unmasked, they do


def test_a_packed_example_is_not_trained_to_guess_the_next_ones_first_token(tmp_path):
    """The target after an example's closing end-of-text is the next example's first token, which the closed one
    (all the model's attention sees there) cannot predict; with an empty prompt and no beginning-of-sequence
    token it was trained on, where --pad-to (one example a window) never trains it."""
    from shardlm.data.loader import open_train_data
    from shardlm.data.prepare import prepare
    pair = [{"prompt": "", "completion": "XY"}, {"prompt": "", "completion": "ZW"}]
    data = write_jsonl(tmp_path / "a.jsonl", pair * 4)
    prepare([data], "byte", tmp_path / "packed", progress=False)
    x, y = open_train_data(tmp_path / "packed", None, 0, 8, 300, 0, 1, 1).train.pairs([0])
    eos = 256
    assert (x == eos).any() and (y[x == eos] == IGNORE).all(), (x, y)
    assert (y[x != eos] != IGNORE).all()  # the rest, answers and their end-of-text, all trained


def test_bad_instruction_data_fails_naming_the_line(tmp_path):
    from shardlm.data.prepare import PrepareError, prepare
    bad = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "a"}])
    with pytest.raises(PrepareError, match=r"b.jsonl:2: needs string fields prompt and completion"):
        prepare([bad], "byte", tmp_path / "o1", progress=False)
    chat = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(PrepareError, match="c.jsonl:1: no assistant message"):
        prepare([chat], "byte", tmp_path / "o2", progress=False)
    # Which field is off: another tool's name for the answer, or a value of another type.
    for record, words in [({"prompt": "a", "response": "b"}, "has 'prompt', 'response'"),
                          ({"prompt": "a", "completion": 5}, "has 'prompt', 'completion' \\(a number\\)"),
                          ({"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]},
                           "message 2 has role 'bot'"),
                          ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
                           "message 1's content is an array"),
                          ({"messages": []}, "it is an array and empty")]:
        with pytest.raises(PrepareError, match=words):
            prepare([write_jsonl(tmp_path / "w.jsonl", [record])], "byte", tmp_path / "o3", progress=False)
    alpaca = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "a", "output": "b"}])  # read as plain text
    with pytest.raises(PrepareError, match="no 'text' field .*for instruction data, write each line as "
                                           '{"prompt", "completion"} or {"messages"'):
        prepare([alpaca], "byte", tmp_path / "o4", progress=False)
    odd = write_jsonl(tmp_path / "o.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                           {"role": "assistant", "content": "yo"}]}])
    tok_dir = tmp_path / "tok"
    from shardlm.tokenizer import load_tokenizer
    load_tokenizer("byte").save(tok_dir)
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message must come first') }}"
        "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")}))
    with pytest.raises(PrepareError, match="o.jsonl:1: a system message must come first"):
        prepare([odd], str(tok_dir), tmp_path / "o5", progress=False)
    text = tmp_path / "t.txt"
    text.write_text("plain text")
    with pytest.raises(PrepareError, match="cannot be prepared into one dataset"):
        prepare([chat, text], "byte", tmp_path / "o3", progress=False)
    with pytest.raises(PrepareError, match="--pad-to applies to instruction examples"):
        prepare([text], "byte", tmp_path / "o4", pad_to=16, progress=False)


def test_eval_loss_is_the_mean_over_held_out_trained_targets(tmp_path):
    import torch.nn.functional as F
    trainer = dist_fns.tiny_trainer(1, {"data.path": sft_data(tmp_path), "train.seq_len": "24", "data.eval_windows": "6",
                                        "train.micro_batch_size": "2", "train.global_batch_size": "8",
                                        "train.eval_batches": "3", "train.device": "cpu"})
    batches = list(trainer.data.eval_batches(3))
    with torch.no_grad():
        summed = sum(F.cross_entropy(trainer.model(x).flatten(0, 1), y.flatten(), reduction="sum") for x, y in batches)
    count = sum(int((y != -100).sum()) for _, y in batches)
    assert len({int((y != -100).sum()) for _, y in batches}) > 1
    assert trainer.evaluate() == pytest.approx(float(summed / count), rel=1e-6)


def test_a_run_from_a_checkpoint_resumes_without_it(tmp_path):
    """Resuming reads the run's checkpoint, not train.init_from again (which may be gone by then)."""
    import shutil
    path, _ = hf_dir(tmp_path)
    over = {"train.init_from": str(path), "train.steps": "4", "train.save_every": "2", "train.keep_checkpoints": "5",
            "lora.rank": "4", "train.device": "cpu"}
    full = dist_fns.train_and_capture(0, 1, over, str(tmp_path / "a"))
    shutil.rmtree(path)
    resumed = dist_fns.train_and_capture(0, 1, over, str(tmp_path / "b"), str(tmp_path / "a" / "checkpoints" / "step_00000002"))
    assert resumed["losses"] == full["losses"][2:]


def test_a_runs_checkpoint_and_export_keep_the_tokenizers_chat_template_and_end_of_text(tmp_path, capsys):
    """The run saves tokenizer_config.json beside tokenizer.json: without it an export of a chat fine-tune had
    no chat template, and generation from the run stopped at another end-of-text token than training's."""
    from helpers import cli_here
    from shardlm.tokenizer import load_tokenizer
    tok_dir = tmp_path / "tok"
    tok = load_tokenizer("byte")
    tok.tok.add_special_tokens(["<|im_end|>"])  # Qwen2-Instruct's end of turn, not the first end-of-text we guess
    tok.save(tok_dir)
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}" \
               "{% if add_generation_prompt %}[assistant]{% endif %}"
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": template}))
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": f"hi {i}"},
                                                            {"role": "assistant", "content": "yo"}]} for i in range(8)])
    cli_here(capsys, "data", "prepare", "--input", data, "--tokenizer", tok_dir, "--out", tmp_path / "data",
             "--pad-to", 32)
    cli_here(capsys, "train", "tiny", "--data.path", tmp_path / "data", "--train.seq_len", 32, "--train.steps", 1,
             "--data.eval_windows", 0, "--train.eval_every", 0, "--train.sample_tokens", 0, "--out", tmp_path / "run")
    cli_here(capsys, "export", "--checkpoint", tmp_path / "run", "--out", tmp_path / "hf")
    for where in (tmp_path / "run" / "checkpoints" / "step_00000001", tmp_path / "hf"):
        assert load_tokenizer(where).eos_id == 257, where
        assert json.loads((where / "tokenizer_config.json").read_text())["chat_template"] == template


def test_a_chat_template_in_chat_template_jinja_is_rendered_and_kept(tmp_path, capsys):
    """transformers >= 4.47 saves a tokenizer's template as chat_template.jinja, which wins over one in
    tokenizer_config.json: prepare renders with it (it was ignored, the plain fallback rendered instead), and the
    dataset, the run's checkpoint and its export keep it."""
    from helpers import cli_here
    template = _prepare_chat(tmp_path, capsys, "{{ 'stale' }}", jinja=True)
    cli_here(capsys, "train", "tiny", "--data.path", tmp_path / "data", "--train.seq_len", 24, "--train.steps", 1,
             "--data.eval_windows", 0, "--train.eval_every", 0, "--train.sample_tokens", 0, "--out", tmp_path / "run")
    cli_here(capsys, "export", "--checkpoint", tmp_path / "run", "--out", tmp_path / "hf")
    for where in (tmp_path / "data", tmp_path / "run" / "checkpoints" / "step_00000001", tmp_path / "hf"):
        assert (where / "chat_template.jinja").read_text() == template, where


def test_named_chat_templates_render_with_the_default_one(tmp_path, capsys):
    """tokenizer_config.json's chat_template as transformers' list of named templates: prepare renders with the one
    named "default", as transformers does (the list was taken for no template, the plain fallback rendered)."""
    _prepare_chat(tmp_path, capsys, [{"name": "tool_use", "template": "{{ 'tools' }}"},
                                     {"name": "default", "template": CHAT}])


CHAT = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}{% endfor %}" \
       "{% if add_generation_prompt %}[assistant]{% endif %}"


def _prepare_chat(tmp_path, capsys, in_config, jinja: bool = False) -> str:
    """`data prepare` of one chat, with tokenizer_config.json's chat_template `in_config` (and CHAT in
    chat_template.jinja where `jinja`) into tmp_path/data, asserting CHAT rendered it; returns CHAT."""
    from helpers import cli_here
    from shardlm.tokenizer import load_tokenizer
    tok_dir = tmp_path / "tok"
    load_tokenizer("byte").save(tok_dir)
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                               "chat_template": in_config}))
    if jinja:
        (tok_dir / "chat_template.jinja").write_text(CHAT)
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                            {"role": "assistant", "content": "yo"}]}] * 8)
    cli_here(capsys, "data", "prepare", "--input", data, "--tokenizer", tok_dir, "--out", tmp_path / "data",
             "--pad-to", 24)
    assert trained_text(tmp_path / "data")[0].startswith("yo#")
    assert trained_text(tmp_path / "data")[1].startswith("[user]hi#[assistant]")
    return CHAT


def _source_with_tokenizer(tmp_path, generation_config: dict):
    """A tiny HF directory with the tests' tokenizer and `generation_config` as its generation_config.json."""
    from helpers import make_tokenizer
    path, _ = hf_dir(tmp_path, vocab_size=300)
    make_tokenizer(path)
    (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


def _run_and_export(tmp_path, capsys, source):
    """Data prepared with `source`'s tokenizer, one step from it at lr 0 (the weights stay the source's), the run
    exported: (checkpoint, export)."""
    from helpers import TEXT, cli_here
    (tmp_path / "text.txt").write_text(TEXT)
    cli_here(capsys, "data", "prepare", "--input", tmp_path / "text.txt", "--tokenizer", source, "--out",
             tmp_path / "data")
    assert not (tmp_path / "data" / "generation_config.json").exists()  # the model's file, not the tokenizer's
    cli_here(capsys, "train", "tiny", "--train.init_from", source, "--data.path", tmp_path / "data",
             "--train.steps", 1, "--train.lr", 0, "--train.warmup_steps", 0, "--train.weight_decay", 0,
             "--data.eval_windows", 0, "--train.eval_every", 0, "--train.sample_tokens", 0, "--out", tmp_path / "run")
    cli_here(capsys, "export", "--checkpoint", tmp_path / "run", "--out", tmp_path / "exp")
    return tmp_path / "run" / "checkpoints" / "step_00000001", tmp_path / "exp"


def test_the_sources_end_of_turn_survives_the_run_and_the_export_and_stops_transformers_there(tmp_path, capsys):
    """A fine-tune of a chat model whose end of turn only generation_config.json names (Llama 3 Instruct's
    eos_token_id [<|end_of_text|>, <|eot_id|>]): the checkpoint keeps the file, the export writes it, and
    shardlm's generate/serve on either and transformers' generate on the export stop at the same token."""
    import shutil

    import transformers

    from helpers import cli_here
    from shardlm.generation_config import stop_ids_of
    from shardlm.inference import generate_ids, generate_text, load_pretrained, prompt_ids
    from shardlm.tokenizer import load_tokenizer
    source = _source_with_tokenizer(tmp_path, {})
    model, tok, _ = load_pretrained(source)
    prompt = prompt_ids(tok, "To be")
    greedy = generate_ids(model, torch.tensor([prompt]), 12)[0].tolist()
    k = next(i for i in range(1, len(greedy)) if greedy[i] not in greedy[:i] and greedy[i] != tok.eos_id)
    turn = greedy[k]  # an end of turn greedy decoding emits, at its first appearance
    gen = {"bos_token_id": 1, "eos_token_id": [tok.eos_id, turn], "temperature": 0.6, "top_p": 0.9,
           "do_sample": True}
    (source / "generation_config.json").write_text(json.dumps(gen))
    checkpoint, export = _run_and_export(tmp_path, capsys, source)
    assert json.loads((checkpoint / "generation_config.json").read_text()) == gen
    assert json.loads((export / "generation_config.json").read_text()) == gen
    hf_gen = transformers.GenerationConfig.from_pretrained(export)
    assert hf_gen.eos_token_id == [tok.eos_id, turn] and hf_gen.temperature == 0.6
    for where in (checkpoint, tmp_path / "run", export):
        loaded, loaded_tok, _ = load_pretrained(where)
        assert stop_ids_of(loaded_tok) == (tok.eos_id, turn), where
        out = cli_here(capsys, "generate", "--model", where, "--prompt", "To be", "--json", "--max-new-tokens", 12,
                       "--compile", "off")
        assert json.loads(out)["completion"] == tok.decode(greedy[:k]), where
        assert generate_text(loaded, loaded_tok, "To be", 12) == tok.decode(greedy[:k]), where  # a run's sample
    # The run's own tokenizer is the prepared data's, which has no generation_config.json: the run's sample
    # takes the end of turn from the weights' source's, as the trainer passes it.
    data_tok = load_tokenizer(tmp_path / "data")
    assert stop_ids_of(data_tok) == (tok.eos_id,) and stop_ids_of(data_tok, gen) == (tok.eos_id, turn)
    assert stop_ids_of(load_tokenizer(export)) == (tok.eos_id, turn)
    hf = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    with torch.no_grad():
        new = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_id)
    assert new[0, len(prompt):].tolist() == greedy[:k + 1]  # transformers keeps the stop token; shardlm cuts it
    shutil.rmtree(source)  # a resumed run keeps the checkpoint's, its init_from gone
    cli_here(capsys, "train", "--resume", tmp_path / "run", "--train.steps", 2)
    assert json.loads((tmp_path / "run" / "checkpoints" / "step_00000002" / "generation_config.json").read_text()) \
        == gen


def test_an_export_without_the_sources_generation_config_has_one_of_config_jsons_ids(tmp_path, capsys):
    """No generation_config.json of the source's own (here transformers' kind, made from the model class, whose
    eos 2 is not this tokenizer's): the export's is the one GenerationConfig.from_model_config makes of its
    config.json, as save_pretrained would write."""
    import transformers
    source = _source_with_tokenizer(tmp_path, {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2})
    checkpoint, export = _run_and_export(tmp_path, capsys, source)
    assert not (checkpoint / "generation_config.json").exists()
    config = json.loads((export / "config.json").read_text())
    written = transformers.GenerationConfig.from_pretrained(export)
    made = transformers.GenerationConfig.from_model_config(transformers.AutoConfig.from_pretrained(export))
    assert (written.bos_token_id, written.eos_token_id) == (config["bos_token_id"], config["eos_token_id"])
    assert (written.bos_token_id, written.eos_token_id) == (made.bos_token_id, made.eos_token_id)
    assert config["eos_token_id"] == 0 and written._from_model_config


def _bos_tokenizer(directory, **config):
    """The tests' byte-level BPE with Llama's habit: a post-processor that opens every text with <s>."""
    from tokenizers import Tokenizer, processors

    from helpers import make_tokenizer
    make_tokenizer(directory)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.add_special_tokens(["<s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|endoftext|>",
        "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}"
                         "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}", **config}))
    return tok.token_to_id("<s>")


def test_texts_open_with_the_tokenizers_beginning_of_sequence_as_transformers_gives_it(tmp_path):
    """A tokenizer that opens texts with a beginning-of-sequence token (Llama's <s>) gets it where transformers
    puts it: before a prompt (generate, serve's completions), once before a chat (its template places it),
    before every document and every prompt/completion example of prepared data; the export's config.json names
    it. tokenizer_config.json's add_bos_token changes nothing (transformers 5 follows tokenizer.json), and a
    tokenizer.json without the post-processor gets none."""
    from transformers import PreTrainedTokenizerFast

    from shardlm.data.instruct import chat_prompter
    from shardlm.data.loader import TokenShards
    from shardlm.data.prepare import prepare
    from shardlm.hf_config import hf_config_from_model
    from shardlm.config import ModelConfig
    from shardlm.inference import prompt_ids
    from shardlm.tokenizer import load_tokenizer
    bos = _bos_tokenizer(tmp_path / "tok")
    tok, theirs = load_tokenizer(tmp_path / "tok"), PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "tok"))
    assert tok.bos_ids == [bos] and tok.bos_token == "<s>"
    assert prompt_ids(tok, "To be, or not") == theirs("To be, or not").input_ids == [bos] + tok.encode("To be, or not")
    chat = [{"role": "user", "content": "hi"}]
    text = chat_prompter(tok)(chat)
    assert text == theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert prompt_ids(tok, text, opened=True) == theirs(text, add_special_tokens=False).input_ids
    assert prompt_ids(tok, text, opened=True).count(bos) == 1

    docs = write_jsonl(tmp_path / "d.jsonl", [{"text": "To be"}, {"text": "or not"}])
    prepare([docs], str(tmp_path / "tok"), tmp_path / "docs", progress=False)
    ids = np.concatenate([np.asarray(t) for t in TokenShards(tmp_path / "docs").tokens]).tolist()
    assert ids == [bos] + tok.encode("To be") + [tok.eos_id] + [bos] + tok.encode("or not") + [tok.eos_id]
    examples = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "Q", "completion": "A"}, {"messages": chat + [
        {"role": "assistant", "content": "yo"}]}])
    prepare([examples], str(tmp_path / "tok"), tmp_path / "ex", progress=False)
    shards = TokenShards(tmp_path / "ex")
    ids = np.concatenate([np.asarray(t) for t in shards.tokens]).tolist()
    mask = np.concatenate([np.asarray(m) for m in shards.masks]).astype(bool).tolist()
    first = [bos] + tok.encode("Q") + tok.encode("A") + [tok.eos_id]
    assert ids[:len(first)] == first and not mask[0] and mask[len(first) - 1]
    assert ids[len(first):].count(bos) == 1 and ids[len(first)] == bos  # the template's own, once

    assert hf_config_from_model(ModelConfig(), eos_id=tok.eos_id, bos_id=bos)["bos_token_id"] == bos
    _bos_tokenizer(tmp_path / "off", add_bos_token=False)
    assert prompt_ids(load_tokenizer(tmp_path / "off"), "To be") == PreTrainedTokenizerFast.from_pretrained(
        str(tmp_path / "off"))("To be").input_ids == [bos] + tok.encode("To be")
    from helpers import make_tokenizer
    make_tokenizer(tmp_path / "plain")
    plain = load_tokenizer(tmp_path / "plain")
    assert plain.bos_ids == [] and plain.bos_token == "" and prompt_ids(plain, "To be") == plain.encode("To be")


def test_instruction_examples_tokenize_as_one_text_as_transformers_does_with_a_sentencepiece_tokenizer(tmp_path):
    """A SentencePiece-style tokenizer (Llama 2's, Mistral's: Metaspace) marks a word start before any text it is
    given alone: an answer encoded apart from its prompt trained a space before it that the model, served the
    prompt, must not produce. Prepared examples are transformers' tokenizer(prompt + completion) and
    apply_chat_template ids, the chat prompt served (/v1/chat/completions) their untrained start."""
    from transformers import PreTrainedTokenizerFast

    from helpers import sentencepiece_style_tokenizer
    from shardlm.data.instruct import chat_prompter
    from shardlm.data.loader import TokenShards
    from shardlm.data.prepare import prepare
    from shardlm.inference import prompt_ids
    from shardlm.tokenizer import load_tokenizer
    tok = sentencepiece_style_tokenizer()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}"
                         "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"}))
    ours, theirs = load_tokenizer(tmp_path / "tok"), PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "tok"))
    chat = [{"role": "user", "content": "say 3"}]
    records = [{"prompt": "Reverse: a b 3\n", "completion": "3 b a"}, {"messages": chat + [
        {"role": "assistant", "content": "3!"}]}]
    prepare([write_jsonl(tmp_path / "e.jsonl", records)], str(tmp_path / "tok"), tmp_path / "ex", progress=False)
    shards = TokenShards(tmp_path / "ex")
    ids = np.concatenate([np.asarray(t) for t in shards.tokens]).tolist()
    mask = np.concatenate([np.asarray(m) for m in shards.masks]).astype(bool).tolist()
    first = theirs("Reverse: a b 3\n3 b a").input_ids + [ours.eos_id]
    second = theirs.apply_chat_template(records[1]["messages"], tokenize=False)
    assert ids == first + theirs(second, add_special_tokens=False).input_ids
    served = prompt_ids(ours, chat_prompter(ours)(chat), opened=True)
    assert ids[len(first):len(first) + len(served)] == served and mask[len(first):] == (
        [False] * len(served) + [True] * (len(ids) - len(first) - len(served)))
    assert mask[:len(first)] == [False] * len(theirs("Reverse: a b 3\n").input_ids) + [True] * (
        len(first) - len(theirs("Reverse: a b 3\n").input_ids))


def test_an_export_stops_transformers_at_the_runs_end_of_text_too(tmp_path, capsys):
    """A base whose generation_config.json ends texts at one token, fine-tuned on data whose tokenizer ends them at
    another (Qwen2.5's base with eos_token set to <|im_end|>): shardlm stopped at both, the export's config.json
    named the data's, but its generation_config.json, which transformers' generate reads, the base's alone."""
    import transformers

    from shardlm.tokenizer import load_tokenizer
    source = _source_with_tokenizer(tmp_path, {"bos_token_id": 1, "eos_token_id": 7, "temperature": 0.6})
    eos = load_tokenizer(source).eos_id
    assert eos != 7
    _, export = _run_and_export(tmp_path, capsys, source)
    written = transformers.GenerationConfig.from_pretrained(export)
    assert written.eos_token_id == [7, eos] and written.temperature == 0.6


def test_a_chat_without_a_template_is_trained_on_the_tokens_it_is_served_as(tmp_path):
    """Under a SentencePiece tokenizer (Metaspace, "<s>" opening each text: Llama 2's, Mistral's) a conversation
    prepared without a chat template was encoded after <s> as a text of its own, a word start (U+2581) before its
    first turn; served (and by transformers' apply_chat_template of the export) through the template written for
    it, "<s>" is part of the text and no word start follows it: every served prompt differed from the trained
    ones at its second token."""
    from helpers import sentencepiece_style_tokenizer
    from shardlm.data.instruct import chat_prompter
    from shardlm.data.loader import TokenShards
    from shardlm.data.prepare import prepare
    from shardlm.inference import prompt_ids
    from shardlm.tokenizer import load_tokenizer
    (tmp_path / "tok").mkdir()
    sentencepiece_style_tokenizer().save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    chat = [{"role": "user", "content": "say 3"}]
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": chat + [{"role": "assistant", "content": "3!"}]}])
    prepare([data], str(tmp_path / "tok"), tmp_path / "out", progress=False)
    trained = np.concatenate([np.asarray(t) for t in TokenShards(tmp_path / "out").tokens]).tolist()
    tok = load_tokenizer(tmp_path / "out")
    served = prompt_ids(tok, chat_prompter(tok)(chat), opened=True)
    assert served[0] == tok.bos_ids[0] and trained[:len(served)] == served, (trained, served)
