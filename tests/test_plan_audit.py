"""`shardlm plan` faults found in an audit: each test is the repro of one, and the behaviour now expected."""
import json

import pytest

from helpers import cli_here, cli_proc


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag", ["--gpu-memory", "--hbm-bw", "--nvlink-bw", "--network-bw"])
@pytest.mark.parametrize("value", ["inf", "1e400"])
def test_an_infinite_gpu_figure_is_refused(capsys, flag, value):
    """--gpu-memory inf with --inference stopped on 'cannot convert float NaN to integer', and --hbm-bw inf
    printed tokens/s Infinity into --json (not JSON): parse_bytes took inf as a positive size."""
    got = cli_proc(capsys, "plan", "--model", "tiny", "--inference", flag, value, "--json")
    assert got.returncode == 2 and f"{flag} '{value}' is not a positive, finite size" in got.stderr



@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [("--hbm-bw", "1e-300B/s", "--tokens", "1e10"),
                                  ("--tokens", "1e300", "--price-per-gpu-hour", "1e300")])
def test_json_never_holds_infinity_or_nan(capsys, args):
    """Out-of-range figures overflowed into train_days Infinity and cost NaN, which json.dumps writes as bare
    Infinity / NaN: no JSON parser takes them. The plan is refused, naming why, instead."""
    got = cli_proc(capsys, "plan", "--model", "tiny", *args, "--json")
    assert got.returncode == 2 and "not a finite number" in got.stderr, got.stdout
    json.loads(got.stdout or "null")  # nothing, or valid JSON



@pytest.mark.timeout(60)
def test_search_names_an_interleaved_layouts_virtual_stages(capsys):
    """--search ranked interleaved layouts at 2 virtual stages but printed them as "pp 8 interleaved": planned or
    trained with --pp-schedule interleaved alone (1 virtual stage) the same layout's bubble doubled (11% -> 22%)."""
    text = cli_here(capsys, "plan", "--model", "llama2-7b", "--gpu", "h100", "--gpus", 64, "--seq", 4096,
                    "--global-batch", 256, "--search", "--top", 12)
    lines = [line for line in text.splitlines() if "interleaved" in line]
    assert lines and all("interleaved v2" in line for line in lines), lines



@pytest.mark.timeout(60)
@pytest.mark.parametrize("extra", [("--tp", 2), ("--pp", 2), ("--search",), ("--largest",)])
def test_params_refuses_what_it_does_not_plan(capsys, extra):
    """--params 7e9 --gpus 8 --tp 2 printed each GPU's model states as if it held the whole model (112 GB at ZeRO 0,
    not 56), and --search / --largest beside --params planned dp 1 without a word."""
    got = cli_proc(capsys, "plan", "--params", "7e9", "--gpus", 8, *map(str, extra))
    assert got.returncode == 2 and "--params" in got.stderr and extra[0] in got.stderr, got.stdout



@pytest.mark.timeout(60)
def test_a_search_with_no_valid_layout_does_not_say_nothing_fits(capsys):
    """--search --gpus 32 --global-batch 4 of tiny scored no layout at all (every one too few micro-batches for its
    pipeline or a dp the batch does not divide), and said "nothing fits ... try more --gpus", which made it worse."""
    got = cli_proc(capsys, "plan", "--model", "tiny", "--search", "--gpus", 32, "--global-batch", 4)
    assert "more --gpus" not in got.stdout and "nothing fits" not in got.stdout
    assert "no layout of 32 GPUs is valid" in got.stdout and "--global-batch" in got.stdout


@pytest.mark.timeout(60)
def test_experts_and_top_k_flags_change_a_presets_mixture_of_experts_each_alone(capsys):
    """--top-k alone on a preset was ignored, --experts reset qwen2-moe-a2.7b's top-4 to 2, and --experts 0 (which
    --help and the refusal of -1 call a dense MLP) planned the preset's experts: each planned without a word."""
    def flops(*flags):
        return json.loads(cli_here(capsys, "plan", "--model", *flags, "--json"))["flops_per_step"]

    assert flops("qwen2-moe-a2.7b", "--experts", "60") == flops("qwen2-moe-a2.7b")
    assert flops("mixtral-tiny", "--top-k", "3") > flops("mixtral-tiny") > flops("mixtral-tiny", "--experts", "0")
    assert flops("mixtral-tiny", "--experts", "0") == flops("tiny")  # its shape, dense
    got = cli_proc(capsys, "plan", "--model", "tiny", "--top-k", "1")
    assert got.returncode == 2 and "--top-k 1 applies to a mixture of experts, and this model is dense" in got.stderr


@pytest.mark.timeout(60)
def test_a_search_with_ring_attention_takes_heads_cp_does_not_divide(capsys):
    """--search --cp 8 --cp-comm p2p of gpt2-124m (12 heads) said "no layout of 8 GPUs is valid": the search
    asked cp to divide the heads as Ulysses does, though the same layout planned without --search was fine."""
    got = cli_proc(capsys, "plan", "--model", "gpt2-124m", "--gpus", 8, "--cp", 8, "--cp-comm", "p2p",
                   "--seq", 1024, "--search")
    assert got.returncode == 0 and "dp 1 cp 8 tp 1 pp 1" in got.stdout, got.stdout + got.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, says", [(("--seq", 31), "--seq 31 must divide by --cp 2"),
                                        (("--seq", 30, "--cp-comm", "p2p"), "--seq 30 must divide by 2 x --cp (2) = 4"),
                                        (("--model", "gpt2-124m", "--gpus", 8, "--cp", 8), "--cp 8 must divide the 12")])
def test_a_search_names_what_cp_asks_of_the_sequence_and_heads(capsys, args, says):
    """--search --cp 2 --seq 31 said only "no layout of 2 GPUs is valid ... try a larger --global-batch or fewer
    --gpus", where the same plan without --search names the sequence length cp must divide."""
    got = cli_proc(capsys, "plan", "--model", "tiny", "--gpus", 2, "--cp", 2, "--search", *map(str, args))
    assert got.returncode == 2 and says in got.stderr, got.stdout + got.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, said", [
    (("--arch", "llama", "--layers", 4, "--hidden", 300, "--heads", 4, "--vocab", 1000),
     "the model: model head size 75 must be even for rotary embeddings"),
    (("--arch", "llama", "--layers", 4, "--hidden", 512, "--heads", 8, "--kv-heads", 3, "--vocab", 1000),
     "the model: --heads 8 is not divisible by --kv-heads 3"),  # the flags typed, not config keys
    (("--arch", "gpt", "--layers", 4, "--hidden", 512, "--heads", 8, "--experts", 4, "--vocab", 1000),
     "the model: --experts 4 needs model.arch = 'llama'"),
    (("--model", "mixtral-tiny", "--top-k", 9), "the model: --top-k 9 must be between 1 and the 4 experts"),
    (("--model", "HF0"), "the Hugging Face config's num_attention_heads = 0 must be positive")])
def test_a_model_train_refuses_is_refused_by_the_plan_too(capsys, tmp_path, args, said):
    """The planner never validated the model: a head size of 75, key/value heads not dividing the heads, GPT-2
    experts were planned without a word, and a config.json with 0 heads ended in a ZeroDivisionError."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_attention_heads": 0,
        "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 128}))
    got = cli_proc(capsys, "plan", *(tmp_path if a == "HF0" else a for a in args))
    assert got.returncode == 2 and said in got.stderr, got.stderr


@pytest.mark.timeout(60)
def test_a_search_over_a_batch_no_run_takes_is_refused_at_once_and_inference_on_one_gpu_is_planned(capsys):
    """--search --global-batch 1e12 tried every divisor one by one and simulated pipelines of millions of
    micro-batches (it ran for minutes); --model tiny at 4.2M said to try a larger batch. --inference --gpus 1,
    one GPU as asked, was refused as tensor-parallel serving. --params beside --lora-rank or --offload printed
    the paper's full states without a word."""
    got = cli_proc(capsys, "plan", "--model", "llama2-7b", "--search", "--gpus", 8, "--global-batch", 10**12)
    assert got.returncode == 2 and "is over 65,536 micro-batches a step on each rank" in got.stderr, got.stderr
    assert "lower it (to 33,554,432 at most here)" in got.stderr
    assert cli_proc(capsys, "plan", "--model", "tiny", "--inference", "--gpus", 1).returncode == 0
    got = cli_proc(capsys, "plan", "--params", "7e9", "--lora-rank", 16, "--offload", "optimizer")
    assert got.returncode == 2 and "--lora-rank, --offload need the model's shape" in got.stderr, got.stderr


@pytest.mark.timeout(60)
def test_expert_dispatch_flags_on_a_dense_model_are_refused(capsys):
    """--ep-dispatch exact and --ep-load-budget 4 beside a dense model were planned without a word, where train
    refuses their keys on a dense model."""
    got = cli_proc(capsys, "plan", "--model", "llama2-7b", "--ep-dispatch", "exact", "--ep-load-budget", 4)
    assert got.returncode == 2 and ("--ep-dispatch exact, --ep-load-budget 4 apply to a mixture of experts, and "
                                    "this model is dense") in got.stderr, got.stderr


@pytest.mark.timeout(60)
def test_a_memory_size_without_a_unit_is_not_read_as_bytes(capsys):
    """--gpu-memory 80 was planned as 80 bytes: 'of 0.00 GiB (DOES NOT FIT)'."""
    got = cli_proc(capsys, "plan", "--model", "tiny", "--gpu-memory", "80")
    assert got.returncode == 2 and "--gpu-memory '80' has no unit and is read as 80 bytes" in got.stderr, got.stderr
    assert cli_proc(capsys, "plan", "--model", "tiny", "--gpu-memory", "8e10").returncode == 0


def _mixtral_dir(directory, layers=2, hidden=64):
    """A Hugging Face Mixtral's config.json alone: what train.init_from's model is read from."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 300, "hidden_size": hidden,
        "intermediate_size": 96, "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 128, "num_local_experts": 4, "num_experts_per_tok": 2}))
    return directory


@pytest.mark.timeout(60)
def test_a_fine_tunes_toml_keeps_its_own_model_keys_over_init_from(tmp_path, capsys):
    """With train.init_from the model section came from its config.json alone: a TOML's [model] capacity_factor,
    router_bias_update_rate or top_k (keys a config.json does not hold, or that the user changed) were dropped
    without a word, while the same keys given as --model.* flags were kept. The file's keys now apply as its
    flags do, a weight key of another model is refused as theirs is, and a preset's [model] still gives way."""
    base = _mixtral_dir(tmp_path / "mix")
    toml = tmp_path / "ft.toml"
    toml.write_text(f'[model]\ncapacity_factor = 1.25\nrouter_bias_update_rate = 0.001\ntop_k = 1\n'
                    f'[train]\ninit_from = "{base}"\n')
    printed = cli_here(capsys, "train", toml, "--print-config")
    assert all(line in printed.splitlines() for line in ("capacity_factor = 1.25", "router_bias_update_rate = 0.001",
                                                         "top_k = 1", "num_experts = 4")), printed
    assert "top_k = 2" in cli_here(capsys, "train", toml, "--model.top_k", "2", "--print-config").splitlines()
    toml.write_text(f'[model]\nnum_layers = 3\n[train]\ninit_from = "{base}"\n')
    got = cli_proc(capsys, "train", toml, "--print-config")
    assert got.returncode == 2 and "model.num_layers is 3 here and 2 in" in got.stderr, got.stderr
    import shardlm
    from pathlib import Path
    for preset in ("tiny", Path(shardlm.__file__).parent / "configs" / "tiny.toml"):  # by name or path, gives way
        assert "num_experts = 4" in cli_here(capsys, "train", preset, "--train.init_from", base, "--print-config")


@pytest.mark.timeout(60)
def test_plan_of_a_fine_tunes_toml_plans_its_init_from_model(tmp_path, capsys):
    """`plan --model FT.toml` planned the file's (default, dense, tiny) [model] while its run trains train.init_from's
    Mixtral: an 8-GPU layout of a 47B model 'fit' in 0.3 GiB, and --ep was refused as needing experts."""
    base = _mixtral_dir(tmp_path / "mix", layers=8, hidden=512)
    toml = tmp_path / "ft.toml"
    toml.write_text(f'[train]\ninit_from = "{base}"\n')
    direct = json.loads(cli_here(capsys, "plan", "--model", base, "--gpus", "2", "--ep", "2", "--json"))
    planned = json.loads(cli_here(capsys, "plan", "--model", toml, "--gpus", "2", "--ep", "2", "--json"))
    assert planned["memory"] == direct["memory"] and planned["flops_per_step"] == direct["flops_per_step"]
    toml.write_text(f'[train]\ninit_from = "{tmp_path / "nowhere"}"\n')
    got = cli_proc(capsys, "plan", "--model", toml, "--gpus", "1")
    assert got.returncode == 2 and f"--model {toml}: train.init_from = " in got.stderr, got.stderr
