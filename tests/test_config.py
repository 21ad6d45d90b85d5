"""Config: presets, TOML, dotted overrides, and validation that names the key and the value."""
import pytest

from shardlm.config import ConfigError, load_config, parse_overrides, preset_names, validate


def test_presets_exist_and_validate():
    assert {"default", "tiny", "gpt2-124m", "tinyllama-1.1b", "llama2-7b", "llama3-8b"} <= set(preset_names())
    for name in preset_names():
        validate(load_config(name))
    t = load_config("tinyllama-1.1b").model
    assert (t.hidden_size, t.num_layers, t.num_heads, t.kv_heads, t.ffn_size, t.vocab_size) == (2048, 22, 32, 4, 5632, 32000)


def test_the_readmes_config_section_names_every_preset():
    """The four mixtures of experts' presets were missing from the list a user reads to choose one."""
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("### Config\n", 1)[1].split("\n### ", 1)[0]
    assert [name for name in preset_names() if f"`{name}`" not in section] == []


def test_toml_file_and_overrides(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text('[model]\nhidden_size = 32\nnum_heads = 2\n[train]\nsteps = 7\nprecision = "bf16"\n')
    cfg = load_config(str(f), parse_overrides(["--train.steps", "9", "--train.lr=1e-4", "--model.tie_embeddings", "true"]))
    assert cfg.model.hidden_size == 32 and cfg.train.steps == 9 and cfg.train.lr == 1e-4
    assert cfg.model.tie_embeddings is True and cfg.train.precision == "bf16"
    assert cfg.grad_accum_steps == cfg.train.global_batch_size // cfg.train.micro_batch_size


@pytest.mark.parametrize("overrides, message", [
    ({"train.nonsense": "1"}, "unknown config key 'train.nonsense'"),
    ({"optim.lr": "1"}, "unknown config key 'optim.lr'"),
    ({"lora.r": "8"}, "unknown config key 'lora.r'; PEFT's r is lora.rank here"),  # other tools' names, said
    ({"train.learning_rate": "1e-4"}, "TrainingArguments's learning_rate is train.lr here"),
    ({"train.save_total_limit": "3"}, "TrainingArguments's save_total_limit is train.keep_checkpoints here"),
    ({"train.report_to": "tensorboard"}, "TrainingArguments's report_to is train.tensorboard"),
    ({"train.steps": "ten"}, "train.steps = 'ten' is not a valid int"),
    ({"train.steps": "0"}, "train.steps = 0 must be positive"),
    ({"model.hidden_size": "-8"}, "model.hidden_size = -8 must be positive"),
    ({"train.global_batch_size": "10", "train.micro_batch_size": "4"}, "train.global_batch_size = 10 is not divisible"),
    ({"model.num_kv_heads": "3"}, "model.num_heads = 4 is not divisible by model.num_kv_heads = 3"),
    ({"train.seq_len": "4096"}, "train.seq_len = 4096 exceeds model.max_seq_len = 128"),
    ({"train.precision": "fp8"}, "train.precision = 'fp8' is not one of fp32, bf16, fp16"),
    ({"train.precision": "BF16"}, "is not one of fp32, bf16, fp16 (did you mean 'bf16'? choices are lowercase)"),
    ({"parallel.pp": "2", "parallel.pp_schedule": "1F1B"}, "(did you mean '1f1b'? choices are lowercase)"),
    ({"train.recompute": "some"}, "train.recompute = 'some' is not one of none, selective, full"),
    ({"train.lr_schedule": "step"}, "train.lr_schedule = 'step'"),
    ({"parallel.offload": "optimizer"}, "parallel.offload = 'optimizer' needs parallel.zero_stage >= 1"),
    ({"parallel.offload": "params"}, "parallel.offload = 'params' needs parallel.zero_stage = 3 (it is 0)"),
    ({"parallel.offload": "optimizer", "parallel.dp_mode": "classic"},
     "needs parallel.zero_stage >= 1 (it is 0) and parallel.dp_mode = 'ddp' (classic DP runs no ZeRO)"),
    ({"parallel.offload_dir": "/tmp/nvme"}, "parallel.offload_dir = '/tmp/nvme' needs parallel.offload optimizer or params"),
    ({"parallel.delayed_update": "true", "parallel.zero_stage": "3", "parallel.offload": "params"},
     "parallel.delayed_update = True is ZeRO-Offload's: it needs parallel.zero_stage = 2 with parallel.offload = 'optimizer'"),
    ({"parallel.delayed_update": "true", "parallel.zero_stage": "2", "parallel.offload": "optimizer",
      "train.precision": "fp16"}, "parallel.delayed_update = True with train.precision = 'fp16'"),
    ({"parallel.zero_stage": "4"}, "parallel.zero_stage = 4 is not one of 0, 1, 2, 3"),
    ({"parallel.offload": "params", "parallel.zero_stage": "2"}, "parallel.offload = 'params' needs parallel.zero_stage = 3"),
    ({"parallel.dp_mode": "classic", "parallel.zero_stage": "1"}, "cannot be combined with parallel.zero_stage = 1"),
    ({"parallel.ep": "2"}, "parallel.ep = 2 needs a mixture-of-experts model"),
    ({"parallel.cp": "8"}, "parallel.cp = 8 must divide the 4 attention heads each tensor-parallel rank holds"),
    ({"parallel.cp": "8"}, "(ring attention, parallel.cp_comm = 'p2p', does not)"),
    ({"parallel.cp": "2", "parallel.cp_comm": "ring"}, "parallel.cp_comm = 'ring' is not one of a2a, p2p"),
    ({"parallel.ep_dispatch": "fixed"}, "parallel.ep_dispatch = 'fixed' is not one of auto, padded, exact"),
    ({"model.num_experts": "4", "parallel.ep_load_budget": "0.5"},
     "parallel.ep_load_budget = 0.5: a rank's experts take at least one balanced load (its own token copies) in one "
     "pass; use 0 (never in chunks) or a finite multiple of at least 1"),
    ({"model.num_experts": "4", "parallel.ep_load_budget": "-1"}, "parallel.ep_load_budget = -1.0 must not be negative"),
    ({"model.num_experts": "4", "parallel.ep_load_budget": "nan"}, "parallel.ep_load_budget = nan must be a finite"),
    ({"parallel.ep_load_budget": "4"}, "parallel.ep_load_budget = 4.0 applies to a mixture of experts, and this model "
                                       "is dense"),
    ({"parallel.cp": "2", "parallel.tp": "2", "parallel.sp": "true", "train.seq_len": "34"},
     "train.seq_len = 34 must divide by parallel.tp = 2 x parallel.cp (2) for sequence parallelism"),
    ({"parallel.cp": "3", "model.num_heads": "6", "model.num_kv_heads": "6", "model.hidden_size": "48",
      "train.seq_len": "32"}, "train.seq_len = 32 must divide by parallel.cp = 3"),
    ({"model.num_experts": "8", "parallel.ep": "2", "parallel.dp": "2", "parallel.dp_mode": "classic"},
     "parallel.dp_mode = 'classic' with parallel.ep = 2"),
    ({"model.num_experts": "4", "parallel.tp": "2", "parallel.dp": "2", "parallel.dp_mode": "classic"},
     "parallel.dp_mode = 'classic' with parallel.tp = 2: the experts, whole on each tensor-parallel rank"),
    ({"model.num_experts": "4", "lora.rank": "8", "lora.targets": "down_proj"},
     "lora.targets = 'down_proj' names MLP linears only, and every layer's MLP is a mixture of experts"),
    ({"model.num_experts": "4", "model.arch": "gpt2", "model.num_kv_heads": "0"}, "needs model.arch = 'llama'"),
    ({"model.moe_every": "0"}, "model.moe_every = 0 must be positive"),
    # A mixture of experts' keys on a dense model (a preset's, or one forgotten num_experts) are not ignored.
    ({"model.capacity_factor": "1.25"}, "model.capacity_factor = 1.25 applies to a mixture of experts, and this "
                                        "model is dense (model.num_experts = 0)"),
    ({"model.router_bias_update_rate": "0.001"}, "model.router_bias_update_rate = 0.001 applies to a mixture"),
    ({"model.sliding_window": "8", "train.attention": "flash"}, "train.attention = 'flash' takes no attention mask"),
    ({"model.arch": "gpt2", "model.num_kv_heads": "0", "model.sliding_window": "8"}, "model.arch = 'gpt2' has no"),
    # trained, then refused by transformers at the export's load (GPT-2's config.json has no head_dim)
    ({"model.arch": "gpt2", "model.num_kv_heads": "0", "model.head_dim": "32"}, "model.head_dim = 32 needs model.arch"),
    # The preset's num_kv_heads, left set under --model.arch gpt2, is the key named.
    ({"model.arch": "gpt2"}, "model.num_kv_heads = 2 needs model.arch = 'llama'"),
    ({"parallel.cp": "2", "parallel.cp_comm": "p2p", "train.seq_len": "30"},
     "train.seq_len = 30 must divide by 2 x parallel.cp (2) = 4 for ring attention's zig-zag layout"),
    ({"model.num_experts": "4", "parallel.ep_dispatch": "padded"}, "parallel.ep_dispatch = 'padded' applies to "
     "expert parallelism, and parallel.ep = 1 (every expert on every rank): set parallel.ep above 1, or leave "
     "parallel.ep_dispatch at 'auto'"),
    # ep_load_budget, which only expert parallelism reads, once accepted at ep 1 without a word.
    ({"model.num_experts": "4", "parallel.ep_load_budget": "4"}, "parallel.ep_load_budget = 4.0 applies to expert "
     "parallelism's exact dispatch, and parallel.ep = 1 (every expert on every rank, each taking its own token "
     "copies): set parallel.ep above 1, or leave parallel.ep_load_budget at 2"),
    # Keys another optimizer or schedule reads, once ignored without a word.
    ({"train.momentum": "0.5"}, "train.momentum = 0.5 applies to train.optimizer = 'sgd', and train.optimizer is "
     "'adamw': set train.optimizer = 'sgd', or leave train.momentum at 0.9"),
    ({"train.optimizer": "sgd", "train.beta2": "0.999"}, "train.beta2 = 0.999 applies to train.optimizer = 'adamw'"),
    ({"train.optimizer": "sgd", "train.eps": "1e-6"}, "train.eps = 1e-06 applies to train.optimizer = 'adamw'"),
    ({"train.lr_schedule": "constant", "train.min_lr_ratio": "0"}, "train.min_lr_ratio = 0.0 applies to "
     "train.lr_schedule = 'cosine' or 'linear', and train.lr_schedule is 'constant'"),
    # 2.5e29 micro-batches a step: the run went on without a word, and SIGTERM, heard between steps, never stopped it.
    ({"train.global_batch_size": "1e30"}, "is over 65,536 micro-batches of train.micro_batch_size (4) per "
     "parallel.dp rank a step, more than any run takes: lower it (to 262,144 at most here)"),
    ({"train.global_batch_size": "8.5"}, "train.global_batch_size = '8.5' is not a valid int"),
    ({"parallel.reduce_dtype": "int8"}, "parallel.reduce_dtype = 'int8' is not one of fp32, compute"),
    ({"parallel.offload_threads": "-1"}, "parallel.offload_threads = -1 must not be negative"),
    ({"parallel.reduce_algo": "tree"}, "parallel.reduce_algo = 'tree' is not one of auto, all_to_all, ring, copy_engine"),
    ({"parallel.reduce_algo": "copy_engine", "parallel.dp_mode": "classic"},
     "parallel.reduce_algo = 'copy_engine' is implemented for DDP and ZeRO, not for parallel.dp_mode = 'classic'"),
])
def test_invalid_values_name_key_and_value(overrides, message):
    with pytest.raises(ConfigError) as e:
        cfg = load_config("tiny", overrides)
        validate(cfg, world_size=cfg.parallel.world)
    assert message in str(e.value)


def test_ring_attention_takes_heads_that_cp_does_not_divide():
    validate(load_config("tiny", {"parallel.cp": "8", "parallel.cp_comm": "p2p"}), world_size=8)


def test_a_dense_model_takes_the_moe_keys_at_their_defaults_or_off():
    """Refused on a dense model where set (misuse table); their defaults and the 0 that means none pass."""
    validate(load_config("tiny", {"model.top_k": "2", "train.moe_aux_loss_coef": "0.01"}))
    validate(load_config("tiny", {"model.top_k": "0", "train.moe_aux_loss_coef": "0"}))


def test_expert_dispatch_at_its_default_passes_without_expert_parallelism():
    validate(load_config("mixtral-tiny", {"parallel.ep_dispatch": "auto"}))


def test_the_keys_of_one_optimizer_or_schedule_pass_under_it_and_at_their_defaults_under_another():
    validate(load_config("tiny", {"train.optimizer": "sgd", "train.momentum": "0", "train.lr_schedule": "constant"}))
    validate(load_config("tiny", {"train.beta1": "0.8", "train.eps": "1e-6", "train.min_lr_ratio": "0",
                                  "train.momentum": "0.9"}))


def test_a_global_batch_of_65536_micro_batches_a_rank_passes():
    validate(load_config("tiny", {"train.global_batch_size": str(4 * 65536)}))


def test_the_expert_load_budget_takes_0_or_at_least_one_balanced_load():
    for budget in ("0", "1", "3.5"):
        validate(load_config("mixtral-tiny", {"parallel.ep_load_budget": budget, "parallel.dp": "2",
                                              "parallel.ep": "2"}), world_size=2)
    validate(load_config("mixtral-tiny", {"parallel.ep_load_budget": "2"}))  # its default, said at ep 1: nothing set


def test_training_beyond_the_sliding_window_validates():
    validate(load_config("tiny", {"model.sliding_window": "8", "train.seq_len": "32"}))


def test_layout_must_match_world_size():
    cfg = load_config("tiny")
    # torchrun --nproc-per-node 2 with no layout flag: it said "launch 1 processes (torchrun --nproc-per-node 1)"
    with pytest.raises(ConfigError, match=r"parallel.dp \(1\) x parallel.tp \(1\) x parallel.pp \(1\) = 1 != world size 2: "
                       r"run one process, without torchrun, or set a layout of 2, e.g. --parallel.dp 2$"):
        validate(cfg, world_size=2)
    with pytest.raises(ConfigError, match=r"parallel.dp \(2\) x parallel.tp \(1\) x parallel.pp \(1\) = 2 != world size 4: "
                       r"launch 2 processes \(torchrun --nproc-per-node 2\), or set a layout of 4, e.g. --parallel.dp 4 "
                       r"--train.micro_batch_size 2$"):  # 8 samples a step, 4 at a time, do not split over 4 ranks
        validate(load_config("tiny", {"parallel.dp": "2"}), world_size=4)
    validate(load_config("tiny", {"parallel.dp": "4", "train.micro_batch_size": "2"}), world_size=4)  # the hint runs
    with pytest.raises(ConfigError, match=r"train.global_batch_size = 8 is not divisible by train.micro_batch_size "
                                          r"\(4\) x parallel.dp \(4\): set train.micro_batch_size to 2$"):
        validate(load_config("tiny", {"parallel.dp": "4"}), world_size=4)
    with pytest.raises(ConfigError, match=r"set train.global_batch_size to a multiple of 4, e.g. 12$"):
        validate(load_config("tiny", {"parallel.dp": "4", "train.micro_batch_size": "1", "train.global_batch_size": "10"}),
                 world_size=4)
    with pytest.raises(ConfigError, match=r"= 2 != world size 3: .* or set a layout of 3 \(the other axes' 2 does not "
                                          r"divide 3\)$"):
        validate(load_config("tiny", {"parallel.tp": "2"}), world_size=3)


def test_a_layout_hint_sets_every_axis_that_would_refuse_the_next_try():
    """The fix the world-size error gives is one that validates: expert and pipeline axes included."""
    cfg = load_config("mixtral-tiny", {"parallel.dp": "2", "parallel.ep": "2", "parallel.pp": "2",
                                       "train.micro_batch_size": "2"})
    with pytest.raises(ConfigError, match=r"set the layout for one \(--parallel.dp 1 --parallel.tp 1 --parallel.pp 1 "
                                          r"--parallel.ep 1; checkpoints"):
        validate(cfg, world_size=1)
    validate(load_config("mixtral-tiny", {"parallel.dp": "1", "parallel.tp": "1", "parallel.pp": "1", "parallel.ep": "1"}),
             world_size=1)
    with pytest.raises(ConfigError, match=r"e.g. --parallel.dp 2 --parallel.ep 2$"):
        validate(load_config("mixtral-tiny", {"parallel.dp": "4", "parallel.ep": "4"}), world_size=2)
    validate(load_config("mixtral-tiny", {"parallel.dp": "2", "parallel.ep": "2"}), world_size=2)


def test_a_pipeline_runs_layer_split_is_named_in_the_way_to_another_layout():
    """A pp run saved with parallel.pp_layers resumes elsewhere: the hint's flags validate, and the split's own
    refusal at another pp says how to drop it (it reads as a malformed value otherwise)."""
    run = {"parallel.pp": "2", "parallel.pp_layers": "1,1"}
    with pytest.raises(ConfigError, match=r"\(--parallel.dp 1 --parallel.tp 1 --parallel.pp 1 --parallel.pp_layers ''; "):
        validate(load_config("tiny", run), world_size=1)
    validate(load_config("tiny", {**run, "parallel.pp": "1", "parallel.pp_layers": ""}), world_size=1)
    with pytest.raises(ConfigError, match=r"summing to the model's 2 layers, or parallel.pp_layers '' for a split "
                                          r"balanced by compute$"):
        validate(load_config("tiny", {**run, "parallel.pp": "1", "parallel.tp": "2"}), world_size=2)


def test_unknown_preset_and_bad_override_syntax():
    with pytest.raises(ConfigError, match="neither a TOML file nor a preset"):
        load_config("no-such-preset")
    with pytest.raises(ConfigError, match=r"config 'runs/my\.toml': no such file \(or a preset: default, "):
        load_config("runs/my.toml")  # a path mistyped: said as such, not as an unknown preset
    with pytest.raises(ConfigError, match="unexpected argument"):
        parse_overrides(["steps", "3"])
    with pytest.raises(ConfigError, match="missing a value"):
        parse_overrides(["--train.steps"])


def test_toml_roundtrip():
    import tomllib
    from shardlm.config import config_from_dict
    cfg = load_config("llama3-8b", {"model.rope_scaling": '{"rope_type": "linear", "factor": 2.0}'})
    again = config_from_dict(tomllib.loads(cfg.to_toml()))
    assert again == cfg


@pytest.mark.timeout(60)
@pytest.mark.parametrize("toml, message", [
    ("[train]\nlearnig_rate = 1e-4\n", "unknown config key 'train.learnig_rate'; did you mean train.lr?"),
    ("[train]\nLR = 1e-4\n", "unknown config key 'train.LR'; did you mean train.lr?"),
    ("[train]\ntp = 2\n", "unknown config key 'train.tp'; did you mean parallel.tp?"),
    ("[parallel]\nzero = 2\n", "unknown config key 'parallel.zero'; did you mean parallel.zero_stage?"),
    ("[model]\nnum_layer = 2\n", "unknown config key 'model.num_layer'; did you mean model.num_layers?"),
    ("[trian]\nlr = 1e-4\n", "unknown config section [trian] in {path}; did you mean [train]?"),
    ("[Train]\nlr = 1e-4\n", "unknown config section [Train] in {path}; did you mean [train]?"),
    # a number where a string goes: TOML reads precision = 16 unquoted
    ("[train]\nprecision = 16\n", "train.precision = 16 is not a valid str: one of fp32, bf16, fp16, in quotes"),
    ("[data]\npath = 5\n", 'data.path = 5 is not a valid str: give it in quotes (path = "5")'),
    ("[train]\nbatch_size = 8\n", "did you mean train.global_batch_size (the sequences of a step) or "
                                   "train.micro_batch_size (those of one forward pass on a rank)?"),
])
def test_a_near_miss_in_a_toml_file_is_named(tmp_path, toml, message):
    """A misspelt key or section was answered with every key of the section (forty of [train]), no pointer."""
    path = tmp_path / "run.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    assert message.format(path=path) in str(e.value)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("text, value", [("9007199254740993", 9007199254740993),
                                         ("18446744073709551615", 2**64 - 1), ("1e23", 10**23), ("1.5e3", 1500)])
def test_an_integer_override_is_read_exactly(text, value):
    """--train.seed 9007199254740993 was read through a float, as ...992 (and 2^64 - 1 as 2^64): an integer key
    takes the value given, in plain or scientific notation, exactly."""
    assert load_config("tiny", parse_overrides(["--train.seed", text])).train.seed == value


@pytest.mark.timeout(30)
def test_a_seed_beyond_64_bits_is_named():
    """train.seed 2^64 passed validation and stopped the run at torch.manual_seed with 'Overflow when unpacking long
    long', naming no key; 2^64 - 1, the largest torch takes, passes."""
    validate(load_config("tiny", {"train.seed": 2**64 - 1}))
    with pytest.raises(ConfigError, match=r"train.seed = 18446744073709551616 does not fit in 64 bits: give a seed "
                                          r"from 0 to 18446744073709551615"):
        validate(load_config("tiny", {"train.seed": str(2**64)}))


@pytest.mark.timeout(30)
def test_a_control_character_in_a_string_survives_config_toml(tmp_path):
    """A string with a control character (--train.sample_prompt $'def\\r') was written into config.toml raw, which
    TOML forbids: the run's own config.toml then read as no run's, and `--resume` into its directory was refused."""
    import tomllib
    from shardlm.config import config_from_dict
    from shardlm.rundir import _run_config
    cfg = load_config("tiny", {"train.sample_prompt": 'def\r"\\\n\t\x1b\x7f'})
    (tmp_path / "config.toml").write_text(cfg.to_toml())
    assert config_from_dict(tomllib.loads(cfg.to_toml())) == cfg and _run_config(tmp_path / "config.toml")


def test_a_home_relative_path_in_a_toml_file_is_the_users_home(tmp_path, monkeypatch):
    """"~/data" in a TOML file (or --data.path=~/data, which no shell expands) was looked for as a directory named
    '~' and refused as missing."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "run.toml").write_text('[data]\npath = "~/data"\n[train]\ninit_from = "~/hf"\n')
    cfg = load_config(str(tmp_path / "run.toml"), {"data.eval_path": "~/held"})
    assert (cfg.data.path, cfg.train.init_from, cfg.data.eval_path) == \
        (str(tmp_path / "data"), str(tmp_path / "hf"), str(tmp_path / "held"))


def test_a_rope_scaling_of_nulls_lists_and_odd_keys_is_written_and_read_back(tmp_path):
    """An HF config.json's rope_scaling may hold null ("attention_factor": null) or a list: writing the run's
    config.toml (and --print-config) raised a TypeError traceback after the model was built; a key with a space or
    a dot was written bare, TOML that did not read back (or read as a nested table)."""
    scaling = '{"rope_type": "linear", "factor": 2.0, "attention_factor": null, "short": [1, 2], "a b": 1, "x.y": 2}'
    cfg = load_config("tiny", {"model.rope_scaling": scaling})
    validate(cfg)
    (tmp_path / "c.toml").write_text(cfg.to_toml())
    assert load_config(str(tmp_path / "c.toml")).model.rope_scaling == \
        {"rope_type": "linear", "factor": 2.0, "short": [1, 2], "a b": 1, "x.y": 2}  # null: unset, as HF reads it


def test_a_config_path_without_its_suffix_is_the_users_file_not_the_preset_of_its_name(tmp_path, monkeypatch):
    """`train ../configs/tiny` joined the relative path onto the presets' directory and trained the bundled tiny
    (an absolute path took the user's file): the user's tiny.toml is the one read, however it is named."""
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny.toml").write_text("[train]\nsteps = 3\n")
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    for source in ("../configs/tiny", str(tmp_path / "configs" / "tiny"), "../configs/tiny.toml"):
        assert load_config(source).train.steps == 3, source
    assert load_config("tiny").train.steps != 3  # a bare name is the preset
    monkeypatch.chdir(tmp_path / "configs")
    assert load_config("./tiny").train.steps == 3 and load_config("tiny").train.steps != 3


def test_a_double_bracketed_section_is_named_as_an_array_of_tables(tmp_path):
    """`[[train]]` read as a key `train` outside any section, "and no section has such a key", about a section."""
    (tmp_path / "c.toml").write_text("[[train]]\nsteps = 5\n")
    with pytest.raises(ConfigError, match=r"c.toml: \[\[train\]\] is an array of tables \(a list of sections\): "
                                          r"write \[train\], one table$"):
        load_config(str(tmp_path / "c.toml"))
