"""Every misuse a user can make of a command, as one row of a table: the command ends with one line
`shardlm <cmd>: error: ...` naming the input and the fix, a non-zero status, no traceback, and nothing on disk
changed (runs, checkpoints, datasets, exports). A new case is one line in CASES.

The commands run in this process (`shardlm.cli.main`), which is what `python -m shardlm` runs, without a
Python start per row; an exception escaping main() fails the row as a traceback would."""
import hashlib
import json
import shutil
import zlib

import pytest
import torch

from helpers import TEXT
from shardlm.cli import main

QUIET = ["--train.tensorboard", "false", "--train.sample_tokens", "0"]

# (id, argv, a fragment of the error line, the status: 2 for what the user gave, 1 for what a run found)
CASES = [
    # resuming with keys that change the model, the adapters or the data
    ("lora-rank", ["train", "--resume", "{lrun}", "--lora.rank", "8"], "lora.rank is 4 in the checkpoint and 8 in this run", 2),
    ("lora-off", ["train", "--resume", "{lrun}", "--lora.rank", "0"], "lora.rank is 4 in the checkpoint and 0", 2),
    ("lora-alpha", ["train", "--resume", "{lrun}", "--lora.alpha", "32"], "lora.alpha is 16.0 in the checkpoint and 32.0", 2),
    ("lora-targets", ["train", "--resume", "{lrun}", "--lora.targets", "q_proj"], "lora.targets is 'q_proj,v_proj' in", 2),
    ("lora-rslora", ["train", "--resume", "{lrun}", "--lora.rslora", "true"], "lora.rslora is False in the checkpoint", 2),
    ("lora-quantize", ["train", "--resume", "{lrun}", "--lora.quantize", "nf4"], "lora.quantize is 'none' in the", 2),
    ("lora-on-full", ["train", "--resume", "{run}", "--lora.rank", "4"], "trained every weight, without adapters", 2),
    ("model-key", ["train", "--resume", "{run}", "--model.num_layers", "3"], "model.num_layers is 2 in the checkpoint", 2),
    ("resume-seq-len", ["train", "--resume", "{run}", "--train.seq_len", "16"],
     "train.seq_len is 32 in the checkpoint and 16 in this run", 2),
    ("resume-eval-windows", ["train", "--resume", "{run}", "--data.eval_windows", "1"],
     "data.eval_windows is 16 in the checkpoint and 1 in this run, which changes the windows left to train on", 2),
    ("resume-global-batch", ["train", "--resume", "{run}", "--train.global_batch_size", "12"],
     "16 samples were consumed, not a whole number of batches; leave it out (a resume without a config or override "
     "continues with the checkpoint's) or set it back to 8, or resume into another --out with one that divides 16",
     2),
    ("resume-optimizer", ["train", "--resume", "{run}", "--train.optimizer", "sgd"],
     "train.optimizer is 'adamw' in the checkpoint and 'sgd' in this run: its saved optimizer state is adamw's", 2),
    ("resume-tokenizer", ["train", "--resume", "{run}", "--data.path", "{swapdata}"],
     "another tokenizer than the checkpoint's", 2),
    ("resume-overwrite-refused", ["train", "--resume", "{run4}/checkpoints/step_00000002", "--overwrite",
                                  "--model.num_layers", "3"], "model.num_layers is 2 in the checkpoint", 2),  # step 4 kept
    ("resume-another-base", ["train", "--resume", "{lrun}", "--train.init_from", "{deeper}"],
     "deeper' in this run, another model (model.num_layers is 2 in the checkpoint and 3 there), which the run would "
     "record as its base", 2),  # recorded as the run's base, which its adapter names
    ("resume-base-missing", ["train", "--resume", "{lrun}", "--train.init_from", "{new}"],
     "no readable Hugging Face config.json", 2),
    ("resume-missing", ["train", "--resume", "{run}/checkpoints/step_00000099"], "does not exist", 2),
    # starting from a checkpoint (train.init_from)
    ("init-tokenizer", ["train", "tiny", "--train.init_from", "{exp}", "--data.path", "{swapdata}", "--out", "{new}"],
     "another tokenizer than train.init_from", 2),
    ("init-truncated", ["train", "tiny", "--train.init_from", "{truncated}", "--data.path", "{data}", "--out", "{new}"],
     "model.safetensors is not a readable safetensors file", 2),
    ("init-empty", ["train", "tiny", "--train.init_from", "{empty}", "--data.path", "{data}", "--out", "{new}"],
     "model.safetensors is not a readable safetensors file", 2),
    ("init-bad-header", ["train", "tiny", "--train.init_from", "{badheader}", "--data.path", "{data}", "--out", "{new}"],
     "model.safetensors is not a readable safetensors file", 2),
    ("init-non-finite", ["train", "tiny", "--train.init_from", "{nonfinite}", "--data.path", "{data}", "--out", "{new}",
                         "--train.steps", "1"], "holds non-finite weights (layers.0.attn.qkv.weight has nan", 1),
    # the model section is the checkpoint's, a config's own max_seq_len gone: the fix is named
    ("init-shorter-context", ["train", "tiny", "--train.init_from", "{exp}", "--train.seq_len", "256", "--out", "{new}"],
     "exceeds model.max_seq_len = 128 (with train.init_from, the checkpoint's config.json's unless "
     "--model.max_seq_len overrides it)", 2),
    ("init-pickled", ["train", "tiny", "--train.init_from", "{pickled}", "--data.path", "{data}", "--out", "{new}"],
     "has no *.safetensors weights: it holds pytorch_model.bin, PyTorch's pickled weights", 2),
    ("init-bert", ["train", "tiny", "--train.init_from", "{bert}", "--data.path", "{data}", "--out", "{new}"],
     "/bert': unsupported Hugging Face architecture 'bert': shardlm builds the decoder-only", 2),
    ("init-config-lacks-key", ["train", "tiny", "--train.init_from", "{nokey}", "--data.path", "{data}", "--out",
                               "{new}"], "/nokey': the Hugging Face config lacks 'hidden_size'", 2),
    ("init-shard-missing", ["train", "tiny", "--train.init_from", "{sharded}", "--data.path", "{data}", "--out",
                            "{new}"], "-00002-of-00003.safetensors, which model.safetensors.index.json lists, is missing", 2),
    ("init-tensor-missing", ["train", "tiny", "--train.init_from", "{tensorless}", "--data.path", "{data}", "--out",
                             "{new}"], "tensorless: the checkpoint lacks model.layers.1.mlp.up_proj.weight", 2),
    ("init-model-key", ["train", "tiny", "--train.init_from", "{exp}", "--data.path", "{data}", "--out", "{new}",
                        "--model.hidden_size", "128"], "model.hidden_size is 128 here and 64 in ", 2),  # before any tensor
    # data and run directories
    ("data-not-prepared", ["train", "tiny", "--data.path", "{text}", "--out", "{new}"],
     "text.txt' is a file; training reads a directory of token shards: shardlm data prepare --input ", 2),
    ("data-path-missing", ["train", "tiny", "--data.path", "{new}/data", "--out", "{new}"], "/data' does not exist: make one", 2),
    ("data-path-the-index", ["train", "tiny", "--data.path", "{data}/index.json", "--out", "{new}"],
     "index.json' is a prepared directory's index: give the directory, ", 2),
    ("vocab-too-small", ["train", "tiny", "--data.path", "{data}", "--model.vocab_size", "100", "--out", "{new}"],
     "prepared with a tokenizer of 257 tokens; prepare it with the model's tokenizer, or (a model trained from "
     "scratch) set model.vocab_size to at least that (0 takes the data's tokenizer size)", 2),
    ("data-shorter-than-window", ["train", "tiny", "--data.path", "{shortdata}", "--out", "{new}"],
     "shortdata holds 27 tokens, fewer than the 33 of one window of train.seq_len 32: lower train.seq_len (to 26 "
     "at most), or prepare more text", 2),
    ("untrained-step", ["train", "tiny", "--data.path", "{fewtrained}", "--train.seq_len", "8", "--train.steps", "5",
                        "--out", "{new}"], "no token of its batch is trained on", 1),
    ("out-is-a-file", ["train", "tiny", "--data.path", "{data}", "--out", "{file}"], "is a file, not a directory", 2),
    ("out-is-a-dataset", ["train", "tiny", "--data.path", "{data}", "--out", "{data}"],
     "is a prepared dataset, not a run directory", 2),
    ("out-is-an-export", ["train", "tiny", "--data.path", "{data}", "--out", "{exp}"], "is an exported model", 2),
    ("out-holds-a-project-config", ["train", "tiny", "--data.path", "{data}", "--out", "{project}"],
     "project holds a config.toml that is not a shardlm run's, which the run would replace", 2),
    ("out-holds-other-metrics", ["train", "tiny", "--data.path", "{data}", "--out", "{othermetrics}"],
     "holds a metrics.jsonl that is not a shardlm run's", 2),
    ("out-in-a-checkpoint", ["train", "tiny", "--data.path", "{data}", "--out", "{run}/checkpoints/step_00000002/x"],
     "which is a checkpoint, not a run directory", 2),
    ("lora-alpha-zero", ["train", "tiny", "--lora.rank", "4", "--lora.alpha", "0", "--out", "{new}"],
     "lora.alpha = 0.0 must be positive", 2),
    ("lora-rank-beyond-width", ["train", "tiny", "--lora.rank", "1000", "--out", "{new}"],
     "lora.rank = 1000 exceeds model.hidden_size = 64, the most an adapter's update B A can have: lower lora.rank "
     "(to 64 at most)", 2),
    ("z-loss-on-dense", ["train", "tiny", "--train.moe_z_loss_coef", "0.001", "--out", "{new}"],
     "train.moe_z_loss_coef = 0.001 applies to a mixture of experts, and this model is dense", 2),
    ("first-dense-on-dense", ["train", "tiny", "--model.moe_first_dense", "1", "--out", "{new}"],
     "model.moe_first_dense = 1 applies to a mixture of experts, and this model is dense", 2),
    # MoE keys with a non-zero default, once ignored on a dense model: `--model.top_k 1` trained it dense
    ("top-k-on-dense", ["train", "tiny", "--model.top_k", "1", "--out", "{new}"],
     "model.top_k = 1 applies to a mixture of experts, and this model is dense (model.num_experts = 0): set "
     "model.num_experts (and model.top_k), or leave model.top_k at 2 or 0", 2),
    ("aux-loss-on-dense", ["train", "tiny", "--train.moe_aux_loss_coef", "0.5", "--out", "{new}"],
     "train.moe_aux_loss_coef = 0.5 applies to a mixture of experts", 2),
    ("router-scoring-on-dense", ["train", "tiny", "--model.router_scoring", "sigmoid", "--out", "{new}"],
     "model.router_scoring = 'sigmoid' applies to a mixture of experts", 2),
    ("freeze-lora-base", ["train", "tiny", "--lora.rank", "4", "--train.freeze", "embed", "--out", "{new}"],
     "train.freeze: 'embed' matches only weights frozen already (the base under LoRA adapters), so it freezes "
     "nothing: name modules that carry adapters (lora.targets), or leave it out", 2),  # once trained as without it
    ("resume-an-export", ["train", "--resume", "{exp}"], "it is a Hugging Face directory: start a run from it", 2),
    ("init-from-a-run", ["train", "tiny", "--train.init_from", "{run}", "--out", "{new}"],
     "it is a shardlm run; continue it with --resume", 2),
    ("init-from-an-adapter", ["train", "tiny", "--train.init_from", "{adapterdir}", "--out", "{new}"],
     "it is a PEFT adapter, not a model; train.init_from takes its base model (org/base)", 2),
    ("eval-tokenizer", ["train", "tiny", "--data.path", "{data}", "--data.eval_path", "{swapdata}", "--out", "{new}"],
     "another tokenizer than data.eval_path", 2),
    # a path given as '' (an unset shell variable): once '.', or not given (a new run for --resume '')
    ("resume-empty", ["train", "tiny", "--resume", ""], "--resume is empty: give a path", 2),
    ("out-empty", ["train", "tiny", "--out="], "--out is empty: give a path", 2),
    ("config-empty", ["train", "", "--out", "{new}"], "the config is empty: give a TOML file or a preset", 2),
    ("generate-model-empty", ["generate", "--model", "", "--prompt", "x"], "--model is empty: give a path", 2),
    ("export-out-empty", ["export", "--checkpoint", "{run}", "--out", ""], "--out is empty: give a path", 2),
    # as an override: the built-in corpus trained without a word, LoRA on a random base
    ("data-path-empty", ["train", "tiny", "--data.path", "", "--out", "{new}"], "--data.path is empty: give a path", 2),
    ("init-from-unset", ["train", "tiny", "--train.init_from=", "--out", "{new}"],
     "--train.init_from is empty: give a path", 2),
    # refused before training, not after the last save
    ("sample-prompt-too-long", ["train", "tiny", "--train.sample_tokens", "8", "--train.sample_prompt", "x" * 200,
                                "--out", "{new}"], "train.sample_prompt is 200 tokens, which leaves no room", 2),
    # other tools' ways of giving a config
    ("config-not-utf8", ["train", "{notutf8}", "--out", "{new}"],
     "notutf8.toml: not UTF-8 text, as TOML must be (byte 23: invalid continuation byte)", 2),
    # a scaling without its type was read as unscaled RoPE, the factor never applied
    ("rope-scaling-no-type", ["train", "tiny", "--model.rope_scaling", '{{"factor": 2}}', "--out", "{new}"],
     "model.rope_scaling sets factor but no rope_type, so nothing would read it: give rope_type ('linear', 'llama3')",
     2),
    ("rope-scaling-default-theta", ["train", "tiny", "--model.rope_scaling", '{{"rope_type": "default", "rope_theta": '
                                    '5e5}}', "--out", "{new}"], "model.rope_scaling sets rope_theta, which rope_type "
     "'default' does not read (the base is model.rope_theta)", 2),
    # the rotary table is built for every position: out of memory, blaming train.seq_len
    ("max-seq-len-huge", ["train", "tiny", "--data.path", "{data}", "--model.max_seq_len", str(10**11), "--out",
                          "{new}"], "model.max_seq_len = 100,000,000,000 needs about 23,841.9 GiB for the rotary", 2),
    ("override-without-dashes", ["train", "tiny", "train.steps=2", "--out", "{new}"],
     "'train.steps=2': an override is written with two dashes: --train.steps=2", 2),
    ("config-flag", ["train", "--config", "tiny", "--out", "{new}"], "--config: the config is the first argument", 2),
    # A key without its section, or as TrainingArguments spells it: argparse said only "unrecognized arguments"
    ("key-no-section", ["train", "tiny", "--lr", "1e-4", "--out", "{new}"],
     "--lr: config keys are written with their section: --train.lr", 2),
    ("key-hf-name", ["train", "tiny", "--learning_rate", "1e-4", "--out", "{new}"],
     "--learning_rate: config keys are written with their section: --train.lr", 2),
    ("toml-key-outside-sections", ["train", "{toplevel}", "--out", "{new}"],
     "toplevel.toml: steps = 2 is outside any [section]: put it under [train]", 2),
    # config keys
    ("key-unknown", ["train", "tiny", "--train.nosuch", "1", "--out", "{new}"], "unknown config key 'train.nosuch'", 2),
    ("key-type", ["train", "tiny", "--train.steps", "abc", "--out", "{new}"], "train.steps = 'abc' is not a valid int", 2),
    ("key-no-value", ["train", "tiny", "--out", "{new}", "--train.steps"], "train.steps is missing a value", 2),
    ("key-no-value-before-flag", ["train", "tiny", "--train.steps", "--out", "{new}"],
     "train.steps is missing a value: give --train.steps VALUE (or --train.steps=VALUE)", 2),  # not a config '{new}'
    ("key-no-value-before-key", ["train", "tiny", "--data.path", "--train.lr", "1e-3", "--out", "{new}"],
     "data.path is missing a value: give --data.path VALUE", 2),  # not data.path = '--train.lr'
    ("key-choice", ["train", "tiny", "--train.precision", "fp8", "--out", "{new}"], "is not one of fp32, bf16, fp16", 2),
    ("key-bool", ["train", "--resume", "{lrun}", "--data.skip_untrained", "maybe"], "is not a valid bool", 2),
    ("free-grads-not-bool", ["train", "tiny", "--train.free_grads", "maybe", "--out", "{new}"],
     "train.free_grads = 'maybe' is not a valid bool: give true or false", 2),
    ("toml-list-for-a-string", ["train", "{listfreeze}", "--out", "{new}"], "train.freeze = ['router', 'experts'] is "
     "not a valid str: give one string, the items separated by commas (freeze = 'router,experts')", 2),
    ("key-eps", ["train", "tiny", "--train.eps", "0", "--out", "{new}"], "train.eps = 0.0 must be positive", 2),
    ("key-ignored", ["train", "tiny", "--data.tokenizer", "gpt2", "--out", "{new}"], "data.tokenizer = 'gpt2' is not one", 2),
    ("key-layout", ["train", "tiny", "--parallel.tp", "2", "--out", "{new}"], "= 2 != world size 1", 2),
    ("copy-engine-on-cpu", ["train", "tiny", "--train.device", "cpu", "--parallel.reduce_algo", "copy_engine", "--out",
                            "{new}"], "parallel.reduce_algo = 'copy_engine' needs CUDA GPUs (peer-to-peer copies), and "
     "this run is on cpu: use parallel.reduce_algo auto", 2),  # with ranks: a traceback once the engine was built
    ("pp-copy-engine-on-cpu", ["train", "tiny", "--train.device", "cpu", "--parallel.pp_transfer", "copy_engine",
                               "--out", "{new}"], "parallel.pp_transfer = 'copy_engine' needs CUDA GPUs", 2),
    # export: never over a checkpoint, a run or a dataset; a non-empty directory only with --overwrite
    ("export-over-checkpoint", ["export", "--checkpoint", "{run}", "--out", "{run}/checkpoints/step_00000002", "--dtype",
                                "bf16"], "is a checkpoint: an export never replaces one", 2),
    ("export-over-run", ["export", "--checkpoint", "{run}", "--out", "{run}"], "is a run directory", 2),
    ("export-over-checkpoints", ["export", "--checkpoint", "{run}", "--out", "{run}/checkpoints"], "checkpoints folder", 2),
    ("export-into-checkpoint", ["export", "--checkpoint", "{run}", "--out", "{run}/checkpoints/step_00000002/hf"],
     "is inside the checkpoint", 2),
    ("export-over-dataset", ["export", "--checkpoint", "{run}", "--out", "{data}"], "is a prepared dataset", 2),
    ("export-non-empty", ["export", "--checkpoint", "{run}", "--out", "{exp}"], "exists and is not empty: pass --overwrite", 2),
    # --overwrite replaces a previous export only: never the directory holding the run (`--out .` in a project)
    ("export-overwrite-project", ["export", "--checkpoint", "{run}", "--out", "{root}", "--overwrite"],
     "is not a previous export (it holds ", 2),
    ("export-overwrite-other-files", ["export", "--checkpoint", "{run}", "--out", "{notes}", "--overwrite"],
     "is not a previous export (it holds notes.txt)", 2),
    ("export-under-a-file", ["export", "--checkpoint", "{run}", "--out", "{file}/hf"],
     "file is a file, so no directory can be made under it", 2),
    ("export-over-file", ["export", "--checkpoint", "{run}", "--out", "{file}"], "is a file", 2),
    ("export-merge-full", ["export", "--checkpoint", "{run}", "--out", "{new}", "--merge"], "is not a LoRA run", 2),
    ("export-fp16-overflow", ["export", "--checkpoint", "{bigrun}", "--out", "{new}", "--dtype", "fp16"],
     "holds values beyond fp16's range (65504)", 2),
    ("export-moe-no-hf-class", ["export", "--checkpoint", "{sigmoidmoe}", "--out", "{new}"],
     "model.router_scoring = 'sigmoid' has no Hugging Face class here (Mixtral and Qwen2-MoE score with a softmax); "
     "shardlm generate, eval and serve read the run itself", 2),
    ("export-an-export", ["export", "--checkpoint", "{exp}", "--out", "{new}"], "holds no complete checkpoint", 2),
    ("export-checkpoints-folder", ["export", "--checkpoint", "{run}/checkpoints", "--out", "{new}"],
     "/checkpoints is the checkpoints folder of the run ", 2),
    ("export-a-file", ["export", "--checkpoint", "{file}", "--out", "{new}"], "is a file; a run, a checkpoint or a", 2),
    ("generate-a-file", ["generate", "--model", "{file}", "--prompt", "x"], "is a file; a run, a checkpoint or a", 2),
    ("export-missing", ["export", "--checkpoint", "{run}/nothing", "--out", "{new}"], "does not exist", 2),
    # data prepare
    ("prepare-nothing-trained", ["data", "prepare", "--input", "{longprompts}", "--tokenizer", "byte", "--out", "{new}",
                                 "--pad-to", "8"], "no example of the 3 has a token to train on", 2),
    ("prepare-pad-to-text", ["data", "prepare", "--input", "{text}", "--tokenizer", "byte", "--out", "{new}", "--pad-to",
                             "8"], "--pad-to applies to instruction examples", 2),
    ("prepare-over-run", ["data", "prepare", "--input", "{text}", "--tokenizer", "byte", "--out", "{run}"],
     "holds files that are not part of a prepared dataset", 2),
    ("prepare-no-input", ["data", "prepare", "--input", "{new}.txt", "--tokenizer", "byte", "--out", "{new}"],
     "does not exist", 2),
    ("prepare-shard-tokens", ["data", "prepare", "--input", "{text}", "--tokenizer", "byte", "--out", "{new}",
                              "--shard-tokens", "5"], "--shard-tokens 5 is out of range", 2),
    ("prepare-a-directory", ["data", "prepare", "--input", "{data}", "--tokenizer", "byte", "--out", "{new}"],
     "is a directory, not a file: give its files (", 2),
    ("prepare-glob-of-nothing", ["data", "prepare", "--input", "{new}/*.jsonl", "--tokenizer", "byte", "--out",
                                 "{new}"], "*.jsonl does not exist (a pattern that matched no file)", 2),
    ("prepare-mixed", ["data", "prepare", "--input", "{text}", "{longprompts}", "--tokenizer", "byte", "--out", "{new}"],
     "cannot be prepared into one dataset", 2),
    ("prepare-empty-input", ["data", "prepare", "--input", "{file}", "--tokenizer", "byte", "--out", "{new}"],
     "/file: no text to tokenize (empty): give files that hold text", 2),
    ("prepare-pad-to-zero", ["data", "prepare", "--input", "{longprompts}", "--tokenizer", "byte", "--out", "{new}",
                             "--pad-to", "0"], "--pad-to 0 must be the training's seq_len, a number of tokens from 1 "
                             "to 16,777,216", 2),
    ("prepare-pad-to-huge", ["data", "prepare", "--input", "{longprompts}", "--tokenizer", "byte", "--out", "{new}",
                             "--pad-to", "100000000000"], "--pad-to 100000000000 must be the training's seq_len", 2),
    ("prepare-no-field", ["data", "prepare", "--input", "{nofield}", "--tokenizer", "byte", "--out", "{new}"],
     "no 'text' field (fields: 'body')", 2),
    ("prepare-input-twice", ["data", "prepare", "--input", "{text}", "{text}", "--tokenizer", "byte", "--out", "{new}"],
     "text.txt is given twice: its text would be in the dataset twice; give each file once", 2),
    ("prepare-text-field-on-text", ["data", "prepare", "--input", "{text}", "--tokenizer", "byte", "--out", "{new}",
                                    "--text-field", "body"], "--text-field body has no effect on these inputs", 2),
    ("prepare-text-field-on-examples", ["data", "prepare", "--input", "{longprompts}", "--tokenizer", "byte", "--out",
                                        "{new}", "--text-field", "prompt"], "--text-field prompt has no effect", 2),
    ("prepare-over-checkpoint", ["data", "prepare", "--input", "{text}", "--tokenizer", "byte", "--out",
                                 "{run}/checkpoints/step_00000002"], "holds files that are not part of a prepared", 2),
    ("prepare-out-not-writable", ["data", "prepare", "--input", "{text}", "--tokenizer", "byte", "--out", "{file}/d"],
     "/file/d cannot be written: ", 2),  # not a scratch directory's name
    ("prepare-no-tokenizer", ["data", "prepare", "--input", "{text}", "--tokenizer", "{new}", "--out", "{new}"],
     "new: no such file or directory; give 'byte', a tokenizer.json, or a directory holding one", 2),
    ("prepare-hub-tokenizer", ["data", "prepare", "--input", "{text}", "--tokenizer", "no-such-org/model", "--out",
                               "{new}"], "for a Hub model, download its tokenizer.json and tokenizer_config.json", 2),
    ("prepare-tokenizerless-dir", ["data", "prepare", "--input", "{text}", "--tokenizer", "{adapterdir}", "--out",
                                   "{new}"], "adapterdir: the directory holds no tokenizer.json; give 'byte'", 2),
    ("prepare-tokenizer-not-json", ["data", "prepare", "--input", "{text}", "--tokenizer", "{text}", "--out", "{new}"],
     "text.txt is not a tokenizer.json the tokenizers library can read (", 2),
    ("prepare-tokenizer-config-not-json", ["data", "prepare", "--input", "{text}", "--tokenizer", "{badtokconfig}",
                                           "--out", "{new}"], "badtokconfig/tokenizer_config.json is not valid JSON (", 2),
    # tokenizer_config.json valid JSON but wrong: a list, an id for eos_token, an eos_token the vocabulary lacks
    # a chat template that does not parse, or is not text: once a traceback, and a number taken for no template
    ("prepare-template-syntax", ["data", "prepare", "--input", "{chat}", "--tokenizer", "{template_syntax}", "--out",
                                 "{new}"], "the chat template does not parse (line 1: unexpected '}'", 2),
    ("prepare-template-number", ["data", "prepare", "--input", "{chat}", "--tokenizer", "{template_number}", "--out",
                                 "{new}"], "chat_template is not a template's text", 2),
    ("prepare-tokenizer-config-list", ["data", "prepare", "--input", "{text}", "--tokenizer", "{tokconfig_list}",
                                       "--out", "{new}"], "tokenizer_config.json holds list, not a JSON object", 2),
    ("prepare-eos-token-id", ["data", "prepare", "--input", "{text}", "--tokenizer", "{tokconfig_id}", "--out",
                              "{new}"], "eos_token is 5, not the token's text", 2),
    ("prepare-eos-token-unknown", ["data", "prepare", "--input", "{text}", "--tokenizer", "{tokconfig_unknown}",
                                   "--out", "{new}"], "eos_token '<nope>' is no token of", 2),
    ("generate-eos-token-unknown", ["generate", "--model", "{tokconfig_model}", "--prompt", "hi"],
     "eos_token '<nope>' is no token of", 2),
    # plan
    ("plan-a-run", ["plan", "--model", "{run}"], "no config.json there: it is a shardlm run; plan it with --model ",
     2),
    ("plan-a-checkpoint", ["plan", "--model", "{run}/checkpoints/step_00000002"],
     "it is a checkpoint of a shardlm run; plan it with --model ", 2),
    ("plan-a-checkpoint-state", ["plan", "--model", "{run}/checkpoints/step_00000002/state.json"],
     "state.json: not a Hugging Face config.json (no architectures or model_type): plan its run with --model ", 2),
    ("plan-zero-seq", ["plan", "--model", "tiny", "--seq", "0"], "--seq (0) must be positive", 2),
    ("plan-an-adapter", ["plan", "--model", "{adapterdir}"], "it is a PEFT adapter; plan its base model with --lora-rank",
     2),
    ("plan-negative-tflops", ["plan", "--model", "tiny", "--gpu-tflops", "-5"], "--gpu-tflops -5 must be a positive", 2),
    ("plan-zero-tflops", ["plan", "--model", "tiny", "--gpu-tflops", "0"], "--gpu-tflops 0 must be a positive", 2),
    ("plan-nan-tflops", ["plan", "--model", "tiny", "--gpu-tflops", "nan"], "--gpu-tflops nan must be a positive", 2),
    ("plan-dp-zero", ["plan", "--model", "tiny", "--dp", "0"], "--dp 0 must be at least 1", 2),
    ("plan-global-batch-zero", ["plan", "--model", "tiny", "--global-batch", "0"], "--global-batch 0 must be at least 1", 2),
    ("plan-top-zero", ["plan", "--model", "tiny", "--search", "--top", "0"], "--top 0 must be at least 1", 2),
    ("plan-hidden-negative", ["plan", "--arch", "llama", "--layers", "2", "--hidden", "-64", "--heads", "4", "--vocab",
                              "100"], "--hidden -64 must be at least 1", 2),
    ("plan-experts-negative", ["plan", "--model", "tiny", "--experts", "-1"], "--experts -1 must not be negative", 2),
    ("plan-tokens-nan", ["plan", "--model", "tiny", "--tokens", "nan"], "--tokens nan must be a finite number", 2),
    ("plan-model-and-shape", ["plan", "--model", "tiny", "--layers", "4"],
     "--model tiny and --layers 4 each give the model, and only one is read: give --model, or --arch", 2),
    ("plan-model-and-params", ["plan", "--model", "tiny", "--params", "1e9"], "--model tiny and --params 1e+09 each", 2),
    ("plan-config-not-json", ["plan", "--model", "{badjson}"], "badjson/config.json is not valid JSON (", 2),
    ("plan-bert", ["plan", "--model", "{bert}/config.json"],
     "bert/config.json: unsupported Hugging Face architecture 'bert'", 2),  # the file named, as generate names it
    ("plan-config-a-list", ["plan", "--model", "{listconfig}"],
     "listconfig/config.json: the Hugging Face config is a JSON list, not an object of keys", 2),
    ("plan-search-zero", ["plan", "--model", "tiny", "--search", "--zero", "3"],
     "--zero 3 has no effect with --search, which tries every dp, tp, pp, ep, ZeRO stage", 2),
    ("plan-search-recompute", ["plan", "--model", "tiny", "--search", "--recompute", "full"],
     "--recompute full has no effect with --search", 2),
    ("plan-search-ep", ["plan", "--model", "mixtral-tiny", "--search", "--ep", "2"], "--ep 2 has no effect with --search",
     2),
    ("plan-search-tp-with-gpus", ["plan", "--model", "tiny", "--search", "--gpus", "4", "--tp", "2"],
     "--tp 2 has no effect with --search", 2),
    ("plan-delayed-update-ep", ["plan", "--model", "mixtral-tiny", "--dp", "2", "--ep", "2", "--zero", "2", "--offload",
                                "optimizer", "--delayed-update", "--seq", "64", "--global-batch", "2"],
     "--delayed-update with --ep 2: the delayed update of two parameter groups", 2),
    ("plan-ep-dispatch-at-ep-1", ["plan", "--model", "mixtral-tiny", "--ep-dispatch", "exact", "--seq", "64",
                                  "--global-batch", "2"], "--ep-dispatch exact applies to expert parallelism, and --ep 1", 2),
    ("plan-ep-load-budget-at-ep-1", ["plan", "--model", "mixtral-tiny", "--ep-load-budget", "4", "--seq", "64",
                                    "--global-batch", "2"], "--ep-load-budget 4.0 applies to expert parallelism", 2),
    ("plan-ep-load-budget-inf", ["plan", "--model", "mixtral-tiny", "--dp", "2", "--ep", "2", "--ep-load-budget", "inf",
                                 "--seq", "64", "--global-batch", "2"], "--ep-load-budget inf: a rank's experts", 2),
    ("plan-search-and-largest", ["plan", "--model", "tiny", "--search", "--largest"], "give one", 2),
    ("plan-price-without-tokens", ["plan", "--model", "tiny", "--price-per-gpu-hour", "2"], "needs --tokens", 2),
    ("plan-unknown-gpu", ["plan", "--model", "tiny", "--gpu", "h900"], "unknown --gpu 'h900'", 2),
    ("plan-gpus-per-node", ["plan", "--model", "tiny", "--gpus-per-node", "0"], "--gpus-per-node 0 must be at least 1", 2),
    ("plan-inference-tp", ["plan", "--model", "tiny", "--inference", "--tp", "2"], "--tp 2: --inference plans one GPU", 2),
    ("plan-inference-context", ["plan", "--model", "tiny", "--inference", "--context", "100000"],
     "between 2 and the model's max_seq_len", 2),
    ("plan-pipeline-micro-batches", ["plan", "--model", "tiny", "--pp", "2", "--global-batch", "1"],
     "needs at least --pp 2 micro-batches per step to fill the pipeline, not 1: raise --global-batch or lower "
     "--micro-batch (or use --pp-schedule gpipe)", 2),
    ("plan-unknown-schedule", ["plan", "--model", "tiny", "--pp", "2", "--global-batch", "4", "--pp-schedule", "foo"],
     "--pp-schedule foo is not one of naive, gpipe", 2),
    ("plan-inference-batch", ["plan", "--model", "tiny", "--inference", "--batch", "0"], "--batch 0 must be at least 1", 2),
    # generate and eval
    ("generate-no-model", ["generate", "--model", "{new}", "--prompt", "x"], "no such directory", 2),
    # no tokenizer.json: converted from the slow tokenizer's files there, else copied from the model's source
    ("generate-slow-tokenizer", ["generate", "--model", "{slowtok}", "--prompt", "x"], "slowtok: it holds "
     "tokenizer.model, a slow tokenizer's files, which shardlm does not read; transformers writes their "
     "tokenizer.json: `AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)`", 2),
    ("generate-no-tokenizer", ["generate", "--model", "{notok}", "--prompt", "x"], "no tokenizer.json at ", 2),
    ("generate-no-tokenizer-how", ["generate", "--model", "{notok}", "--prompt", "x"],
     "notok; copy the tokenizer's files (tokenizer.json, tokenizer_config.json) from where the model came from", 2),
    ("prepare-slow-tokenizer", ["data", "prepare", "--input", "{text}", "--tokenizer", "{slowtok}", "--out", "{new}"],
     "the directory holds no tokenizer.json: it holds tokenizer.model, a slow tokenizer's files", 2),
    ("generate-pickled", ["generate", "--model", "{pickled}", "--prompt", "x"],
     "has no *.safetensors weights: it holds pytorch_model.bin", 2),
    ("serve-no-weights", ["serve", "--model", "{noweights}", "--port", "0"],
     "has no *.safetensors weights: download or export the weights into it", 2),
    ("generate-bert", ["generate", "--model", "{bert}", "--prompt", "x"],
     "bert/config.json: unsupported Hugging Face architecture 'bert'", 2),
    ("generate-config-lacks-key", ["generate", "--model", "{nokey}", "--prompt", "x"],
     "nokey/config.json: the Hugging Face config lacks 'hidden_size'", 2),
    # config.json values of the wrong type: each once a traceback, from arithmetic on them or the model's build
    ("generate-config-string-size", ["generate", "--model", "{strsize}", "--prompt", "x"],
     "strsize/config.json: the Hugging Face config holds a value of the wrong type (", 2),
    ("generate-config-null-layers", ["generate", "--model", "{nulllayers}", "--prompt", "x"],
     "nulllayers/config.json: model.num_layers = None is not a valid int (shardlm's name for the config.json", 2),
    ("plan-config-string-eps", ["plan", "--model", "{streps}"], "streps/config.json: model.norm_eps = 'x' is not", 2),
    ("generate-config-a-list", ["generate", "--model", "{listconfig}", "--prompt", "x"],
     "listconfig/config.json: the Hugging Face config is a JSON list, not an object of keys", 2),
    ("init-config-a-list", ["train", "tiny", "--train.init_from", "{listconfig}", "--out", "{new}"],
     "the Hugging Face config is a JSON list, not an object of keys", 2),
    ("generate-config-not-json", ["generate", "--model", "{badjson}", "--prompt", "x"],
     "badjson/config.json is not valid JSON (", 2),
    ("generate-shard-missing", ["generate", "--model", "{sharded}", "--prompt", "x"],
     "-00002-of-00003.safetensors, which model.safetensors.index.json lists, is missing", 2),
    ("generate-truncated", ["generate", "--model", "{truncated}", "--prompt", "x"], "is not a readable safetensors", 2),
    ("generate-too-long", ["generate", "--model", "{exp}", "--prompt", "x", "--max-new-tokens", "100000"],
     "--prompt: a prompt of 1 token + --max-new-tokens 100000 exceeds the model's max_seq_len 128: lower "
     "--max-new-tokens to 127 at most, or shorten the prompt", 2),
    ("generate-too-long-line", ["generate", "--model", "{exp}", "--input", "{longline}", "--output", "{new}.jsonl"],
     "longline.jsonl:3: a prompt of 20 tokens + max_new_tokens 200 exceeds the model's max_seq_len 128: lower "
     "max_new_tokens to 108 at most", 2),  # its line, not 'prompt 2' (a blank line before it)
    ("generate-prompt-too-long", ["generate", "--model", "{exp}", "--prompt", "x" * 200],
     "a prompt of 200 tokens + --max-new-tokens 64 exceeds the model's max_seq_len 128: shorten the prompt to "
     "fewer than 128 tokens", 2),
    ("generate-top-p", ["generate", "--model", "{exp}", "--prompt", "x", "--top-p", "0"], "--top-p 0.0 is in (0, 1]", 2),
    ("generate-negative-new", ["generate", "--model", "{exp}", "--prompt", "x", "--max-new-tokens", "-1"],
     "--max-new-tokens -1 must not be negative", 2),
    ("generate-nan-temperature", ["generate", "--model", "{exp}", "--prompt", "x", "--temperature", "nan"],
     "--temperature nan must be a finite number", 2),
    # beyond float32 and int64, as the engine holds them: once a traceback after the model had loaded
    ("generate-huge-temperature", ["generate", "--model", "{exp}", "--prompt", "x", "--temperature", "1e39"],
     "--temperature 1e+39 must be a finite number in [0, 3.403e+38]", 2),
    ("generate-huge-top-k", ["generate", "--model", "{exp}", "--prompt", "x", "--temperature", "1", "--top-k",
                             str(10**23)], f"--top-k {10**23} must not be negative (0: every token) and fit in 64", 2),
    ("generate-line-huge-temperature", ["generate", "--model", "{exp}", "--input", "{line_hotter}", "--output",
                                        "{new}.jsonl"], "line_hotter.jsonl:1: temperature = 1e+39 exceeds 3.403e+38", 2),
    ("generate-line-huge-integer", ["generate", "--model", "{exp}", "--input", "{line_huge_int}", "--output",
                                    "{new}.jsonl"], "must be a number within a double's range", 2),  # OverflowError
    ("generate-template-raises", ["generate", "--model", "{raising}", "--input", "{chats}", "--output", "{new}.jsonl"],
     "chats.jsonl:2: the model's chat template fails on a conversation: no system turn here", 2),  # its line named
    ("generate-huge-seed", ["generate", "--model", "{exp}", "--prompt", "x", "--seed", str(10**30)],
     "does not fit in 64 bits", 2),
    ("generate-max-batch", ["generate", "--model", "{exp}", "--prompt", "x", "--max-batch", "0"],
     "--max-batch 0 must be at least 1", 2),
    ("generate-no-output", ["generate", "--model", "{exp}", "--input", "{longprompts}"], "--input needs --output", 2),
    ("generate-output-exists", ["generate", "--model", "{exp}", "--input", "{longprompts}", "--output", "{text}"],
     "exists: pass --overwrite", 2),
    ("generate-bad-line", ["generate", "--model", "{exp}", "--input", "{nofield}", "--output", "{new}"],
     "nofield.jsonl:1: needs a string field prompt", 2),
    ("generate-no-input", ["generate", "--model", "{exp}", "--input", "{new}", "--output", "{new}.jsonl"],
     "no such file", 2),
    ("generate-empty-stop", ["generate", "--model", "{exp}", "--prompt", "def ", "--stop", ""],
     "--stop '': a stop must be a non-empty string", 2),
    ("generate-max-tokens", ["generate", "--model", "{exp}", "--input", "{line_max_tokens}", "--output", "{new}.jsonl"],
     ("line_max_tokens.jsonl:1: unknown key 'max_tokens' (the key here is max_new_tokens); a line holds prompt, "
      "messages, id, max_new_tokens, temperature"), 2),
    ("generate-key-typo", ["generate", "--model", "{exp}", "--input", "{line_typo}", "--output", "{new}.jsonl"],
     "line_typo.jsonl:1: unknown key 'temprature'; a line holds prompt", 2),
    ("generate-fraction", ["generate", "--model", "{exp}", "--input", "{line_fraction}", "--output", "{new}.jsonl"],
     "line_fraction.jsonl:1: max_new_tokens = 2.7 must be an integer", 2),
    ("generate-bool-int", ["generate", "--model", "{exp}", "--input", "{line_bool}", "--output", "{new}.jsonl"],
     "line_bool.jsonl:1: max_new_tokens = true must be an integer", 2),
    ("generate-string-int", ["generate", "--model", "{exp}", "--input", "{line_string}", "--output", "{new}.jsonl"],
     "line_string.jsonl:1: top_k = \"x\" must be an integer", 2),
    ("generate-string-number", ["generate", "--model", "{exp}", "--input", "{line_hot}", "--output", "{new}.jsonl"],
     "line_hot.jsonl:1: temperature = \"hot\" must be a number", 2),
    ("generate-negative-temperature", ["generate", "--model", "{exp}", "--input", "{line_cold}", "--output",
                                       "{new}.jsonl"], "line_cold.jsonl:1: temperature = -1 must not be negative", 2),
    ("generate-line-top-p", ["generate", "--model", "{exp}", "--input", "{line_top_p}", "--output", "{new}.jsonl"],
     "line_top_p.jsonl:1: top_p = 1.5 must be in (0, 1]", 2),
    # a lone surrogate (a \ud800 escape, or bytes the shell passed that are not UTF-8): once the tokenizer's TypeError
    ("generate-line-surrogate", ["generate", "--model", "{exp}", "--input", "{line_surrogate}", "--output",
                                 "{new}.jsonl"], "line_surrogate.jsonl:1: 'prompt' holds an unpaired surrogate", 2),
    ("eval-line-surrogate", ["eval", "--model", "{exp}", "--tasks", "bleu", "--data", "{line_surrogate}"],
     "line_surrogate.jsonl:1: 'prompt' holds an unpaired surrogate", 2),
    ("prepare-line-surrogate", ["data", "prepare", "--input", "{line_surrogate}", "--tokenizer", "byte", "--out",
                                "{new}"], "line_surrogate.jsonl:1: 'prompt' holds an unpaired surrogate", 2),
    ("generate-prompt-not-utf8", ["generate", "--model", "{exp}", "--prompt", "ab\udcff"],
     "--prompt holds the byte 0xff, which is not UTF-8 text", 2),
    ("train-override-not-utf8", ["train", "tiny", "--train.sample_prompt", "a\udcff", "--out", "{new}"],
     "train.sample_prompt holds the byte 0xff, which is not UTF-8 text", 2),
    ("generate-prompt-type", ["generate", "--model", "{exp}", "--input", "{line_prompt}", "--output", "{new}.jsonl"],
     "line_prompt.jsonl:1: prompt must be a string, not a number", 2),
    ("generate-adapter-a-run", ["generate", "--model", "{exp}", "--adapter", "{lrun}", "--prompt", "x"],
     "it is a shardlm run or checkpoint: `shardlm export --checkpoint ", 2),
    ("generate-adapter-a-model", ["generate", "--model", "{exp}", "--adapter", "{exp}", "--prompt", "x"],
     "it is a model, not an adapter: give it as --model", 2),
    ("generate-prompt-output", ["generate", "--model", "{exp}", "--prompt", "x", "--output", "{new}"],
     "--output goes with --input", 2),
    # flags that do not apply where given, once ignored without a word
    ("generate-greedy-top-k", ["generate", "--model", "{exp}", "--prompt", "x", "--top-k", "5"],
     "--top-k 5 has no effect at --temperature 0, which decodes greedily: give --temperature above 0", 2),
    ("eval-greedy-top-p", ["eval", "--model", "{exp}", "--tasks", "bleu", "--data", "{longprompts}", "--top-p", "0.9"],
     "--top-p 0.9 has no effect at --temperature 0", 2),
    ("generate-prompt-overwrite", ["generate", "--model", "{exp}", "--prompt", "x", "--overwrite"],
     "--overwrite goes with --output", 2),
    ("generate-input-json", ["generate", "--model", "{exp}", "--input", "{longprompts}", "--output", "{new}.jsonl",
                             "--json"], "--json goes with --prompt", 2),
    ("generate-tp-zero", ["generate", "--model", "{exp}", "--prompt", "x", "--tp", "0"], "--tp 0 must be at least 1", 2),
    ("serve-tp-negative", ["serve", "--model", "{exp}", "--tp", "-2"], "--tp -2 must be at least 1", 2),
    ("generate-tp-device-index", ["generate", "--model", "{exp}", "--prompt", "x", "--tp", "2", "--device", "cuda:1"],
     "--device cuda:1 with --tp 2: each rank takes the GPU of its local rank", 2),
    ("generate-output-is-input", ["generate", "--model", "{exp}", "--input", "{longprompts}", "--output",
                                  "{longprompts}", "--overwrite"], "is the --input file", 2),
    ("generate-output-a-directory", ["generate", "--model", "{exp}", "--input", "{longprompts}", "--output", "{data}",
                                     "--overwrite"], "is a directory: name a file", 2),
    ("generate-output-no-parent", ["generate", "--model", "{exp}", "--input", "{longprompts}", "--output",
                                   "{new}/out.jsonl"], "new does not exist", 2),
    ("generate-input-a-directory", ["generate", "--model", "{exp}", "--input", "{data}", "--output", "{new}.jsonl"],
     "is a directory, not a file", 2),
    ("generate-device", ["generate", "--model", "{exp}", "--prompt", "x", "--device", "foo"],
     "--device 'foo' is not a device (auto, cpu, cuda, cuda:N)", 2),
    ("serve-device", ["serve", "--model", "{exp}", "--device", "foo"],
     "--device 'foo' is not a device (auto, cpu, cuda, cuda:N)", 2),
    ("generate-run-before-first-save", ["generate", "--model", "{unsaved}", "--prompt", "x"],
     "it is a run that has saved no checkpoint yet", 2),
    ("eval-run-before-first-save", ["eval", "--model", "{unsaved}", "--data", "{text}", "--seq-len", "8"],
     "it is a run that has saved no checkpoint yet", 2),
    # a checkpoint whose state.json was deleted: once "saved no checkpoint yet: wait for its first"
    ("export-state-json-missing", ["export", "--checkpoint", "{nostate}", "--out", "{new}"],
     "nostate/checkpoints/step_00000002 has no state.json, which a save writes last (a save still under way, or "
     "one cut short or damaged)", 2),
    ("eval-batch-size", ["eval", "--model", "{exp}", "--data", "{text}", "--seq-len", "8", "--batch-size", "0"],
     "--batch-size 0 must be at least 1", 2),
    ("eval-window-too-long", ["eval", "--model", "{exp}", "--data", "{text}", "--seq-len", "100000"],
     "exceeds the model's max_seq_len", 2),
    ("eval-text-shorter-than-window", ["eval", "--model", "{exp}", "--data", "{shorttext}", "--seq-len", "64"],
     "the text has 26 tokens, fewer than one window of --seq-len 64: lower --seq-len to 26 at most, or give a "
     "longer text", 2),
    ("eval-empty-text", ["eval", "--model", "{exp}", "--data", "{file}", "--seq-len", "8"],
     "the text has 0 tokens, fewer than one window of --seq-len 8: give a longer text", 2),
    ("eval-no-seq-len", ["eval", "--model", "{exp}", "--data", "{text}"],
     "the loss task needs --seq-len N, the length of the windows it scores (the run's train.seq_len", 2),
    ("eval-data-a-directory", ["eval", "--model", "{exp}", "--data", "{data}", "--seq-len", "8"],
     "is a directory, not a file", 2),
    ("eval-bleu-data-a-directory", ["eval", "--model", "{exp}", "--data", "{data}", "--tasks", "bleu"],
     "is a directory, not a file", 2),
]

# generate --input lines, each wrong in one way (see the generate rows)
BAD_LINES = {"line_max_tokens": {"prompt": "a", "max_tokens": 3}, "line_typo": {"prompt": "a", "temprature": 0.5},
             "line_fraction": {"prompt": "a", "max_new_tokens": 2.7},
             "line_bool": {"prompt": "a", "max_new_tokens": True}, "line_string": {"prompt": "a", "top_k": "x"},
             "line_hot": {"prompt": "a", "temperature": "hot"}, "line_prompt": {"prompt": 5},
             "line_cold": {"prompt": "a", "temperature": -1}, "line_hotter": {"prompt": "a", "temperature": 1e39},
             "line_huge_int": {"prompt": "a", "top_p": 10**400}, "line_top_p": {"prompt": "a", "top_p": 1.5},
             "line_surrogate": {"prompt": "a\ud800", "completion": "b"}}  # written as the escape \ud800


def _files(root):
    """Every file under root by path: its size and hash."""
    return {str(p.relative_to(root)): (p.stat().st_size, hashlib.sha1(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*")) if p.is_file()}


def _cli(argv, capsys):
    capsys.readouterr()
    try:
        status = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's own errors
        status = e.code
    err = capsys.readouterr().err.replace("\r", "\n")
    return status, [line for line in err.strip().splitlines() if line and not line.startswith("tokenize:")]  # the bar


def _swapped_byte_tokenizer(directory):
    """The byte tokenizer with two ids exchanged: its vocabulary's size, other meanings."""
    from shardlm.tokenizer import byte_tokenizer
    spec = json.loads(byte_tokenizer().to_str())
    vocab = spec["model"]["vocab"]
    a, b = [k for k, v in vocab.items() if v in (97, 98)]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    directory.mkdir()
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    p = {name: root / name for name in ("run", "lrun", "exp", "data", "swapdata", "truncated", "empty", "badheader",
                                        "nonfinite", "fewtrained")}
    p["text"], p["file"], p["longprompts"] = root / "text.txt", root / "file", root / "long.jsonl"
    p["adapterdir"] = root / "adapterdir"  # what PEFT's save_pretrained writes, weights aside
    p["adapterdir"].mkdir()
    (p["adapterdir"] / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/base"}))
    p["notes"] = root / "notes"  # a directory of the user's own files, no export
    p["notes"].mkdir()
    (p["notes"] / "notes.txt").write_text("mine")
    p["project"] = root / "project"  # a project's own config.toml: `--out .` there replaced it
    p["project"].mkdir()
    (p["project"] / "config.toml").write_text('[tool.poetry]\nname = "mine"\n')
    p["othermetrics"] = root / "othermetrics"  # another tool's metrics.jsonl
    p["othermetrics"].mkdir()
    (p["othermetrics"] / "metrics.jsonl").write_text('{"epoch": 1, "acc": 0.5}\n')
    p["toplevel"] = root / "toplevel.toml"  # a key above the first [section]
    p["toplevel"].write_text("steps = 2\n[model]\nnum_layers = 1\n")
    p["listfreeze"] = root / "listfreeze.toml"  # a TOML list where the key takes one comma-separated string
    p["listfreeze"].write_text('[train]\nfreeze = ["router", "experts"]\n')
    p["notutf8"] = root / "notutf8.toml"  # Latin-1, say
    p["notutf8"].write_bytes(b"[train]\nsteps = 2\n# caf\xe9\n")
    p["nofield"] = root / "nofield.jsonl"
    p["nofield"].write_text(json.dumps({"body": "text"}) + "\n")
    for name, line in BAD_LINES.items():
        p[name] = root / f"{name}.jsonl"
        p[name].write_text(json.dumps(line) + "\n")
    p["text"].write_text(TEXT * 4)
    p["longline"] = root / "longline.jsonl"
    long_line = json.dumps({"prompt": "x" * 20, "max_new_tokens": 200})
    p["longline"].write_text(json.dumps({"prompt": "a"}) + "\n\n" + long_line + "\n")  # line 3, prompt 2
    p["file"].write_text("")
    p["longprompts"].write_text("".join(json.dumps({"prompt": "x" * 20, "completion": "y"}) + "\n" for _ in range(3)))
    few = root / "few.jsonl"
    few.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n"
                   + "".join(json.dumps({"prompt": "x" * 20, "completion": "y"}) + "\n" for _ in range(39)))
    _swapped_byte_tokenizer(root / "swapped")
    p["badtokconfig"] = root / "badtokconfig"  # a tokenizer whose tokenizer_config.json was cut short
    shutil.copytree(root / "swapped", p["badtokconfig"])
    (p["badtokconfig"] / "tokenizer_config.json").write_text('{"eos_token": ')
    p["chat"] = root / "chat.jsonl"
    p["chat"].write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                  {"role": "assistant", "content": "yo"}]}) + "\n")
    for name, template in (("syntax", "{% for m in messages %}{{ m.content }"), ("number", 5)):
        p[f"template_{name}"] = root / f"template_{name}"
        shutil.copytree(root / "swapped", p[f"template_{name}"])
        (p[f"template_{name}"] / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    for name, settings in (("list", "[]"), ("id", '{"eos_token": 5}'), ("unknown", '{"eos_token": "<nope>"}')):
        p[f"tokconfig_{name}"] = root / f"tokconfig_{name}"
        shutil.copytree(root / "swapped", p[f"tokconfig_{name}"])
        (p[f"tokconfig_{name}"] / "tokenizer_config.json").write_text(settings)

    def ok(*argv):
        status = main([str(a) for a in argv])
        assert status == 0, argv

    ok("data", "prepare", "--input", p["text"], "--tokenizer", "byte", "--out", p["data"])
    ok("data", "prepare", "--input", p["text"], "--tokenizer", root / "swapped", "--out", p["swapdata"])
    p["shorttext"] = root / "short.txt"
    p["shorttext"].write_text("hello world, a short text\n")  # 26 bytes and the end of text
    p["shortdata"] = root / "shortdata"
    ok("data", "prepare", "--input", root / "short.txt", "--tokenizer", "byte", "--out", p["shortdata"])
    ok("data", "prepare", "--input", few, "--tokenizer", "byte", "--out", p["fewtrained"], "--pad-to", "8")
    # Full tensors: the fp16 case below edits model.safetensors.
    ok("train", "tiny", *QUIET, "--train.steps", "2", "--data.path", p["data"], "--out", p["run"],
       "--train.checkpoint_format", "full")
    p["run4"] = root / "run4"
    ok("train", "tiny", *QUIET, "--train.steps", "4", "--train.save_every", "2", "--data.path", p["data"], "--out",
       p["run4"])
    ok("train", "tiny", *QUIET, "--train.steps", "2", "--data.path", p["data"], "--lora.rank", "4", "--lora.targets",
       "q_proj,v_proj", "--out", p["lrun"])
    ok("export", "--checkpoint", p["run"], "--out", p["exp"])
    p["tokconfig_model"] = root / "tokconfig_model"  # an HF model whose tokenizer_config.json names no token of it
    shutil.copytree(p["exp"], p["tokconfig_model"])
    (p["tokconfig_model"] / "tokenizer_config.json").write_text('{"eos_token": "<nope>"}')
    p["sigmoidmoe"] = root / "sigmoidmoe"  # a mixture of experts scored as DeepSeek-V3's: no HF class
    ok("train", "mixtral-tiny", *QUIET, "--train.steps", "1", "--data.path", p["data"], "--out", p["sigmoidmoe"],
       "--model.router_scoring", "sigmoid")
    p["raising"] = root / "raising"  # a chat template that refuses a conversation, as templates on the Hub do
    shutil.copytree(p["exp"], p["raising"])
    (p["raising"] / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system turn here') }}{% endif %}"
        "{{ m.role }}: {{ m.content }}\n{% endfor %}")
    p["chats"] = root / "chats.jsonl"
    p["chats"].write_text("".join(json.dumps({"messages": turns}) + "\n" for turns in (
        [{"role": "user", "content": "hi"}], [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])))
    p["nostate"] = root / "nostate"  # a run whose only checkpoint lost its state.json
    shutil.copytree(p["run"], p["nostate"])
    (p["nostate"] / "checkpoints" / "step_00000002" / "state.json").unlink()
    p["unsaved"] = root / "unsaved"  # a run before its first save: its config and metrics, no checkpoints yet
    p["unsaved"].mkdir()
    shutil.copy(p["run"] / "config.toml", p["unsaved"])
    (p["unsaved"] / "metrics.jsonl").write_text("")
    weights = (p["exp"] / "model.safetensors").read_bytes()
    for name in ("truncated", "empty", "badheader", "nonfinite"):
        shutil.copytree(p["exp"], p[name])
    (p["truncated"] / "model.safetensors").write_bytes(weights[:len(weights) // 2])
    (p["empty"] / "model.safetensors").write_bytes(b"")
    (p["badheader"] / "model.safetensors").write_bytes(b"\xff" * 8 + weights[8:])
    from safetensors.torch import load_file, save_file
    p["bigrun"] = root / "bigrun"  # a checkpoint whose weights fp16 cannot hold (its checksums updated)
    shutil.copytree(p["run"], p["bigrun"])
    ckpt = p["bigrun"] / "checkpoints" / "step_00000002"
    tensors = load_file(ckpt / "model.safetensors")
    tensors["embed.weight"][0, 0] = 1e6
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    state = json.loads((ckpt / "state.json").read_text())
    state["files"]["model.safetensors"] = {"bytes": (ckpt / "model.safetensors").stat().st_size,
                                           "crc32": zlib.crc32((ckpt / "model.safetensors").read_bytes())}
    (ckpt / "state.json").write_text(json.dumps(state))
    for name in ("pickled", "noweights"):  # an HF directory without safetensors: PyTorch's .bin, or nothing
        p[name] = root / name
        shutil.copytree(p["exp"], p[name], ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save(load_file(p["exp"] / "model.safetensors"), p["pickled"] / "pytorch_model.bin")
    for name in ("slowtok", "notok"):  # no tokenizer.json: Llama's SentencePiece file instead, or nothing
        p[name] = root / name
        shutil.copytree(p["exp"], p[name], ignore=shutil.ignore_patterns("tokenizer*"))
    (p["slowtok"] / "tokenizer.model").write_bytes(b"\x0a\x00")
    for name in ("nokey", "badjson"):  # config.json cut short: without a key the model needs, or not JSON at all
        p[name] = root / name
        shutil.copytree(p["exp"], p[name])
    hf = json.loads((p["exp"] / "config.json").read_text())
    (p["nokey"] / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if k != "hidden_size"}))
    (p["badjson"] / "config.json").write_text(json.dumps(hf)[:40])
    p["deeper"] = root / "deeper"  # the config of another model: one more layer
    p["deeper"].mkdir()
    (p["deeper"] / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": 3}))
    for name, wrong in (("strsize", {"hidden_size": "64"}), ("nulllayers", {"num_hidden_layers": None}),
                        ("streps", {"rms_norm_eps": "x"})):
        p[name] = root / name
        shutil.copytree(p["exp"], p[name])
        (p[name] / "config.json").write_text(json.dumps({**hf, **wrong}))
    p["listconfig"] = root / "listconfig"  # valid JSON, but not an object
    p["listconfig"].mkdir()
    (p["listconfig"] / "config.json").write_text("[]")
    p["bert"] = root / "bert"  # an encoder, not a decoder-only language model (its weights would not matter)
    p["bert"].mkdir()
    (p["bert"] / "config.json").write_text(json.dumps({"model_type": "bert"}))
    p["sharded"], p["tensorless"] = root / "sharded", root / "tensorless"  # a shard the index lists, a tensor: gone
    shutil.copytree(p["exp"], p["tensorless"])
    tensors = load_file(p["exp"] / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"},
              p["tensorless"] / "model.safetensors", metadata={"format": "pt"})
    shutil.copytree(p["exp"], p["sharded"], ignore=shutil.ignore_patterns("*.safetensors"))
    names = sorted(tensors)
    parts = [names[i::3] for i in range(3)]
    for i, part in enumerate(parts):
        if i != 1:
            save_file({k: tensors[k] for k in part}, p["sharded"] / f"model-{i + 1:05d}-of-00003.safetensors")
    (p["sharded"] / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f"model-{i + 1:05d}-of-00003.safetensors" for i, part in enumerate(parts) for k in part}}))
    tensors = load_file(p["nonfinite"] / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.weight"][0, 0] = float("nan")
    save_file(tensors, p["nonfinite"] / "model.safetensors", metadata={"format": "pt"})
    return root, p


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_misuse_is_one_line_a_status_and_no_change(world, case, tmp_path, capsys):
    root, paths = world
    _, argv, fragment, want = case
    names = {**paths, "new": tmp_path / "new", "root": root}
    argv = [str(a).format(**names) for a in argv]
    argv[1:1] = QUIET if argv[0] == "train" else []
    before = _files(root)
    status, lines = _cli(argv, capsys)
    assert lines, f"no message for {argv}"
    assert status == want, (status, lines)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"shardlm {argv[0]}: error: ") and fragment in lines[0], lines
    assert _files(root) == before
    new = tmp_path / "new"
    if want == 2:  # refused before it began: nothing made
        assert not new.exists() or not any(new.iterdir()), list(new.iterdir())
    else:  # stopped by what it found once running: no checkpoint, no metrics
        assert {p.name for p in new.iterdir()} <= {".shardlm.lock", "config.toml"}


def test_a_gpu_that_is_not_there_is_named_by_the_commands_flag(world, monkeypatch, capsys):
    """generate, eval and serve choose the device by --device, not train.device (with or without a GPU here)."""
    _, paths = world
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    for cmd, *rest in (["generate", "--prompt", "x"], ["eval", "--data", paths["text"], "--seq-len", "8"], ["serve"]):
        status, lines = _cli([cmd, "--model", paths["exp"], "--device", "cuda", *rest], capsys)
        want = (f"shardlm {cmd}: error: --device 'cuda', but no CUDA device is visible to this process: use "
                "--device auto or cpu")
        assert status == 2 and lines == [want], lines


def test_an_output_that_cannot_be_written_is_named_before_the_model_loads(world, tmp_path, monkeypatch, capsys):
    """generate --output in a read-only directory: a traceback from open(), after the model had loaded."""
    import os

    import shardlm.inference.load as load
    from helpers import unwritable
    _, paths = world
    out = unwritable(tmp_path, "shardlm-out.jsonl")
    monkeypatch.setattr(load, "load_pretrained", lambda *a, **k: pytest.fail("the model loaded"))
    status, lines = _cli(["generate", "--model", paths["exp"], "--input", paths["longprompts"], "--output", out],
                         capsys)
    assert status == 2 and len(lines) == 1 and f"--output {out} cannot be written" in lines[0], lines
    assert not os.path.exists(out)


def test_skip_untrained_counts_the_steps_it_skips(world, tmp_path, capsys):
    _, paths = world
    run = tmp_path / "run"
    status = main(["train", "tiny", *QUIET, "--data.path", str(paths["fewtrained"]), "--train.seq_len", "8",
                   "--train.steps", "5", "--data.skip_untrained", "true", "--out", str(run)])
    assert status == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    assert last["step"] == 5 and 3 <= last["untrained_steps"] <= 5
    skipped = [r for r in records if r["loss"] is None]  # no loss, no update: no 0.0000 reported
    assert len(skipped) == last["untrained_steps"] and all(r["grad_norm"] is None for r in skipped)
    assert json.loads((run / "checkpoints" / "step_00000005" / "state.json").read_text())["untrained_steps"] == \
        last["untrained_steps"]


def test_a_dataset_records_its_tokenizer(world):
    from shardlm.tokenizer import fingerprint, load_tokenizer
    _, paths = world
    for name in ("data", "swapdata", "fewtrained"):
        index = json.loads((paths[name] / "index.json").read_text())
        assert index["tokenizer_fingerprint"] == fingerprint(load_tokenizer(paths[name]))
    assert fingerprint(load_tokenizer(paths["data"])) != fingerprint(load_tokenizer(paths["swapdata"]))
    assert json.loads((paths["fewtrained"] / "index.json").read_text())["untrained_examples"] == 39


def test_an_adapter_is_refused_on_a_model_that_carries_it(world, tmp_path, capsys):
    """`check_adapter_target`, which generate, eval and serve call before loading: a LoRA run (merged on load) and a
    merged export of the adapter's own run are refused; a plain model takes the adapter."""
    from shardlm.adapter_check import check_adapter_target
    from shardlm.config import ConfigError
    _, paths = world
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert main(["export", "--checkpoint", str(paths["lrun"]), "--out", str(adapter)]) == 0
    assert main(["export", "--checkpoint", str(paths["lrun"]), "--out", str(merged), "--merge"]) == 0
    with pytest.raises(ConfigError, match=r"is a LoRA run \(lora.rank = 4\) whose adapters are merged into it"):
        check_adapter_target(paths["lrun"], adapter)
    with pytest.raises(ConfigError, match="is a LoRA run"):
        check_adapter_target(paths["lrun"] / "checkpoints" / "step_00000002", adapter)
    with pytest.raises(ConfigError, match="is a merged export that already holds this adapter"):
        check_adapter_target(merged, adapter)
    check_adapter_target(paths["exp"], adapter)  # a plain model
    check_adapter_target(paths["run"], adapter)  # a run without adapters
    capsys.readouterr()
    for model in (merged, paths["lrun"]):  # the commands call it: one line, status 2, before any decoding
        for cmd in (["generate", "--prompt", "x"], ["eval", "--data", str(paths["text"]), "--seq-len", "8"],
                    ["serve"]):
            spec = f"mine={adapter}" if cmd[0] == "serve" else str(adapter)
            assert main([cmd[0], "--model", str(model), "--adapter", spec, *cmd[1:]]) == 2
            err = capsys.readouterr().err.strip()
            assert "\n" not in err and ("applied twice" in err or "merged into it" in err), err
    assert main(["generate", "--model", str(adapter), "--prompt", "x"]) == 2  # the adapter given as the model
    assert "it is a PEFT adapter: give its base model and this as --adapter" in capsys.readouterr().err


def test_an_adapter_of_another_models_shape_is_named(world, tmp_path):
    from shardlm.config import ConfigError, load_config
    from shardlm.parallel.lora import read_peft_dir
    _, paths = world
    adapter = tmp_path / "adapter"
    assert main(["export", "--checkpoint", str(paths["lrun"]), "--out", str(adapter)]) == 0
    read_peft_dir(adapter, load_config("tiny").model)
    with pytest.raises(ConfigError, match=r"q_proj adapter of layer 0 has A \(4, 64\).*needs A \(4, 128\)"):
        read_peft_dir(adapter, load_config("tiny", {"model.hidden_size": "128"}).model)
    with pytest.raises(ConfigError, match="it adapts layer 1, the model has 1 layers"):
        read_peft_dir(adapter, load_config("tiny", {"model.num_layers": "1"}).model)
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:50])  # a copy cut short
    with pytest.raises(ConfigError, match="is not a readable PEFT adapter directory"):
        read_peft_dir(adapter, load_config("tiny").model)
    with pytest.raises(ConfigError, match="it is a file: give the directory holding it"):
        read_peft_dir(weights, load_config("tiny").model)


def test_an_export_is_written_whole_or_not_at_all(world, tmp_path, monkeypatch, capsys):
    """A failure mid-write (a full disk) leaves --out as it was, also under --overwrite; no scratch is left."""
    import shardlm.model.hf as hf
    _, paths = world
    out = tmp_path / "out"
    assert main(["export", "--checkpoint", str(paths["run"]), "--out", str(out)]) == 0
    before = _files(out)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(hf, "save_file", full_disk)
    status, lines = _cli(["export", "--checkpoint", paths["run"], "--out", out, "--overwrite", "--dtype", "bf16"], capsys)
    assert status != 0 and "No space left on device" in lines[-1] and len(lines) == 1, lines
    assert _files(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    monkeypatch.undo()
    assert main(["export", "--checkpoint", str(paths["run"]), "--out", str(out), "--overwrite", "--dtype", "bf16"]) == 0
    assert _files(out) != before
    from safetensors.torch import load_file
    assert next(iter(load_file(out / "model.safetensors").values())).dtype == torch.bfloat16


def test_a_resume_may_change_what_leaves_the_model_as_it_is(world, tmp_path):
    """Not over-refused: adapter dropout, the step count and the output directory are free on a resume."""
    _, paths = world
    out = tmp_path / "out"
    assert main(["train", "--resume", str(paths["lrun"]), *QUIET, "--lora.dropout", "0.1", "--train.steps", "3",
                 "--out", str(out)]) == 0
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 3


def test_an_eval_with_nothing_held_out_is_said(world, tmp_path, capsys):
    _, paths = world
    assert main(["train", "tiny", *QUIET, "--data.path", str(paths["data"]), "--train.steps", "1", "--train.eval_every",
                 "1", "--data.eval_windows", "0", "--out", str(tmp_path / "run")]) == 0
    assert "note: train.eval_every = 1 but nothing is held out for eval" in capsys.readouterr().out


def test_windows_held_out_that_no_eval_reads_are_said(tmp_path, capsys):
    """With train.eval_every = 0 the last data.eval_windows (up to a tenth of the data) were still held out, never
    trained on, without a word: a sorted instruction set lost its last examples. Said where they are 1% or more
    of the data, with both fixes; not where an eval reads them or none are held out."""
    data = tmp_path / "set.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"question {i}?", "completion": f"answer {i}."}) + "\n"
                            for i in range(200)))
    assert main(["data", "prepare", "--input", str(data), "--tokenizer", "byte", "--out", str(tmp_path / "d"),
                 "--pad-to", "32"]) == 0
    for over, said in ((["--train.eval_every", "0"], True), (["--train.eval_every", "2"], False),
                       (["--train.eval_every", "0", "--data.eval_windows", "0"], False)):
        capsys.readouterr()
        assert main(["train", "tiny", *QUIET, "--data.path", str(tmp_path / "d"), "--train.seq_len", "32",
                     "--train.steps", "1", "--out", str(tmp_path / "run"), "--overwrite", *over]) == 0
        out = capsys.readouterr().out
        note = (f"note: the last 16 windows of {tmp_path / 'd'} are held out for eval and never trained on, and "
                "train.eval_every = 0 evaluates none: set data.eval_windows = 0 to train on them")
        assert (note in out) == said, out


def test_instruction_data_smaller_than_a_batch_or_a_window_is_said(tmp_path, capsys):
    """Three examples packed into one window: 8 copies of it made each batch and the examples past it were never
    trained on, without a word. Said, with the fix; with --pad-to every example has its window."""
    data = tmp_path / "few.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"question {i}?", "completion": f"answer {i}."}) + "\n"
                            for i in range(3)))
    for pad in ([], ["--pad-to", "32"]):
        assert main(["data", "prepare", "--input", str(data), "--tokenizer", "byte", "--out", str(tmp_path / "d"),
                     *pad]) == 0
        capsys.readouterr()
        assert main(["train", "tiny", *QUIET, "--data.path", str(tmp_path / "d"), "--train.seq_len", "32",
                     "--train.steps", "1", "--train.eval_every", "0", "--out", str(tmp_path / "run"),
                     "--overwrite"]) == 0
        out = capsys.readouterr().out
        windows = 3 if pad else 1
        assert (f"holds {windows} training window{'s' * (windows > 1)}, fewer than train.global_batch_size = 8: "
                f"every step's batch repeats {'them' if pad else 'it'}") in out, out
        assert ("are never trained on; --pad-to 32 in `data prepare` gives each example a window" in out) != bool(pad)


def test_a_warmup_longer_than_the_run_is_said(world, tmp_path, capsys):
    """Accepted (a short test run may mean it), but said: the learning rate would never reach train.lr."""
    _, paths = world
    for steps, warmup, said in ((2, 3, True), (2, 2, False)):
        capsys.readouterr()
        assert main(["train", "tiny", *QUIET, "--data.path", str(paths["data"]), "--train.steps", str(steps),
                     "--train.warmup_steps", str(warmup), "--out", str(tmp_path / f"run{warmup}")]) == 0
        out = capsys.readouterr().out
        assert ("note: train.warmup_steps = 3 exceeds train.steps = 2: the learning rate climbs only to 2.00e-03, not "
                "train.lr = 3.00e-03, and never decays; lower train.warmup_steps to 2 at most" in out) == said, out


@pytest.mark.parametrize("env, fragment", [
    ({"WORLD_SIZE": "2", "RANK": "0"}, "WORLD_SIZE = 2 but MASTER_ADDR and MASTER_PORT are not set: start the ranks "
     "with torchrun (torchrun --nproc-per-node 2 -m shardlm ...)"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "localhost"},  # the heartbeat's KeyError
     "WORLD_SIZE = 2 but MASTER_PORT is not set"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "localhost", "MASTER_PORT": "abc"},
     "the environment variable MASTER_PORT = 'abc' is not a whole number 1 to 65535: set it to a free port"),
    ({"WORLD_SIZE": "two"}, "the environment variable WORLD_SIZE = 'two' is not a whole number 1 or more: unset it"),
    ({"WORLD_SIZE": "2", "RANK": "x", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"},
     "the environment variable RANK = 'x' is not a whole number 0 to 1"),
    # It joined as a client of a store no rank serves: C++ frames, then 'a peer rank died or stalled'.
    ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
     "the environment variable RANK = '2' is not a whole number 0 to 1: the ranks of WORLD_SIZE = 2 are numbered"),
    # Half of a job script's variables: a rank 1 trained alone, unsaid; every rank took rank 0 (C++ frames first).
    ({"RANK": "1"}, "RANK = '1' but WORLD_SIZE is not set: unset RANK to run one process, or start the ranks with "
     "torchrun"),
    ({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
     "WORLD_SIZE = 2 but RANK is not set: start the ranks with torchrun (torchrun --nproc-per-node 2 -m shardlm ...)"),
    ({"LOCAL_WORLD_SIZE": "two"}, "the environment variable LOCAL_WORLD_SIZE = 'two' is not a whole number 1 or more"),
    # `srun -n 2 python -m shardlm ...`: each task trained alone (or was refused the run directory), Slurm unnamed.
    ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"}, "this is task 1 of a Slurm step of 2 (SLURM_STEP_NUM_TASKS), "
     "but torchrun's variables (WORLD_SIZE, RANK, MASTER_ADDR) are not set: each task would run alone"),
], ids=["no-rendezvous", "no-port", "port-not-a-number", "world-not-a-number", "rank-not-a-number", "rank-past-world",
        "rank-without-world", "world-without-rank", "local-world-not-a-number", "slurm-tasks-without-torchrun"])
def test_torchruns_variables_set_wrong_by_hand_are_named(env, fragment, tmp_path, monkeypatch, capsys):
    """Before any rendezvous (which would wait for ranks never started) and before --out is made."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for argv in (["train", "tiny", *QUIET, "--parallel.dp", "2", "--out", tmp_path / "new"],
                 ["generate", "--model", "tiny", "--prompt", "x", "--tp", "2"]):
        status, lines = _cli(argv, capsys)
        assert status == 2 and len(lines) == 1 and fragment in lines[0], lines
    assert not (tmp_path / "new").exists()


def test_srun_tasks_without_local_rank_on_a_node_of_several_gpus_are_named(tmp_path, monkeypatch, capsys):
    """srun's tasks given RANK and WORLD_SIZE by a job script, not LOCAL_RANK: every task of a node took its first
    GPU (NCCL's "Duplicate GPU detected", said as a peer that stalled). A task shown its one GPU
    (--gpus-per-task 1) is right to take it."""
    from shardlm.runtime.launch_env import world_from_env
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_LOCALID": "1", "WORLD_SIZE": "4", "RANK": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    status, lines = _cli(["train", "tiny", *QUIET, "--parallel.dp", "4", "--out", tmp_path / "new"], capsys)
    assert status == 2 and len(lines) == 1 and ("this is task 1 on its node of a Slurm step of 2(x2) tasks per node, "
                                                "and LOCAL_RANK is not set: every task of a node would take its first "
                                                "GPU; set LOCAL_RANK=$SLURM_LOCALID") in lines[0], lines
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert world_from_env() == (4, 1, 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a rank without a GPU")
def test_a_rank_told_to_train_on_a_gpu_it_lacks_stops_before_the_rendezvous(tmp_path, monkeypatch, capsys):
    """train.device cuda on a node whose driver failed: the rank joined with gloo, its peers with NCCL, and all
    waited out parallel.timeout_s before 'a peer rank died or stalled'; the missing GPU was never named."""
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    status, lines = _cli(["train", "tiny", *QUIET, "--parallel.dp", "2", "--train.device", "cuda", "--out",
                          tmp_path / "new"], capsys)
    assert status == 2 and lines == ["shardlm train: error: train.device = 'cuda', but no CUDA device is visible to "
                                     "this process: use train.device auto or cpu"], lines
    assert not (tmp_path / "new").exists()


@pytest.mark.timeout(60)
def test_a_master_port_in_use_is_named_by_rank_0_started_by_hand(tmp_path, monkeypatch, capsys):
    """Rank 0 listens on MASTER_PORT for the others: one in use was a screen of TCPStore's C++ frames, then 'a peer
    rank died or stalled' (train) or a DistNetworkError traceback (generate --tp 2)."""
    import socket
    for name in ("LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for name, value in {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
            monkeypatch.setenv(name, value)
        for argv in (["train", "tiny", *QUIET, "--parallel.dp", "2", "--parallel.timeout_s", "5", "--out",
                      tmp_path / "new"], ["generate", "--model", "tiny", "--prompt", "x", "--tp", "2"]):
            status, lines = _cli(argv, capsys)
            assert status == 2 and len(lines) == 1, lines
            assert (f"MASTER_PORT = {port} is in use on this host (another job, or a server, listens there), and rank 0 "
                    "listens on it for the others: set MASTER_PORT to a free port") in lines[0], lines
    assert not (tmp_path / "new").exists()


@pytest.mark.timeout(60)
def test_a_master_addr_that_names_no_host_is_named_at_once(tmp_path, monkeypatch, capsys):
    """A MASTER_ADDR typo: rank 1's store client retried it for all of parallel.timeout_s (600 s by default), through
    screens of C++ warnings, then blamed 'a peer rank died or stalled'."""
    import socket
    host = "no-such-host.invalid"  # RFC 2606: a name that never resolves
    try:
        socket.getaddrinfo(host, 29500)
        pytest.skip(f"{host} resolves here")
    except socket.gaierror as e:
        if e.errno != socket.EAI_NONAME:
            pytest.skip(f"this machine's resolver cannot tell ({e})")
    for name in ("LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": host, "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    for argv in (["train", "tiny", *QUIET, "--parallel.dp", "2", "--parallel.timeout_s", "5", "--out", tmp_path / "new"],
                 ["generate", "--model", "tiny", "--prompt", "x", "--tp", "2"]):
        status, lines = _cli(argv, capsys)
        assert status == 2 and len(lines) == 1, lines
        assert f"MASTER_ADDR = '{host}' does not resolve to an address" in lines[0], lines
    assert not (tmp_path / "new").exists()


@pytest.mark.timeout(60)
def test_generate_tp_whose_peer_never_starts_says_what_it_waits_for(monkeypatch, capsys):
    """Rank 0 of `generate --tp 2` started by hand, rank 1 never (or with another MASTER_PORT): it waited in silence
    for torch's 30 minutes, then ended in a DistStoreError traceback. Now, as train's rendezvous does, it says what
    it waits for, and at the timeout stops with one line."""
    import shardlm.inference.commands as commands
    from shardlm.testing.distributed import free_port
    monkeypatch.setattr(commands, "TIMEOUT_S", 4.0)
    for name in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(name, raising=False)
    port = free_port()
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    status, lines = _cli(["generate", "--model", "tiny", "--prompt", "x", "--tp", "2"], capsys)
    assert status == 1 and len(lines) == 2, lines
    assert lines[0] == (f"shardlm: waiting for all 2 ranks to join at 127.0.0.1:{port} (for up to 4 s): each must be "
                        "started, with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE"), lines
    assert lines[1].startswith(f"shardlm generate: error: the 2 ranks of --tp 2 did not all join at 127.0.0.1:{port} "
                               "within 4 s ("), lines


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["eval", "--data", "{text}", "--seq-len", "8"],
                                     ["serve", "--port", "0"]], ids=["generate", "eval", "serve"])
def test_inference_under_torchrun_without_tp_is_refused_before_the_model(command, world, monkeypatch, capsys):
    """`torchrun --nproc-per-node 2 -m shardlm generate` without --tp ran the whole model in each process (every
    answer printed twice, an --output written twice), and serve's rank 1 ended on an AttributeError."""
    import shardlm.inference
    import shardlm.inference.load

    def never(*a, **k):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(shardlm.inference.load, "load_pretrained", never)
    monkeypatch.setattr(shardlm.inference, "load_pretrained", never)
    _, paths = world
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    argv = [command[0], "--model", str(paths["exp"]), *[str(a).format(**paths) for a in command[1:]]]
    status, lines = _cli(argv, capsys)
    assert status == 2 and len(lines) == 1, lines
    assert ("this is one of 2 processes (WORLD_SIZE = 2, as torchrun sets it) but --tp is 1: each would run the "
            "whole model and repeat the same work; split the model with --tp 2") in lines[0], lines


def test_a_sequence_too_long_for_memory_is_named_before_the_model(world, tmp_path, monkeypatch, capsys):
    """train.seq_len 10**6 typed for 10**3: refused by its activations before any is allocated (on a CPU the kernel
    killed the process without a word); an out-of-memory error once running names train.seq_len too."""
    import shardlm.cli as cli
    import shardlm.memory_check as memory_check
    _, paths = world
    monkeypatch.setattr(memory_check, "free_memory", lambda device: 8 << 30)
    argv = ["train", "tiny", *QUIET, "--data.path", paths["data"], "--model.max_seq_len", "1000000",
            "--train.seq_len", "1000000", "--out", tmp_path / "new"]
    status, lines = _cli(argv, capsys)
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith("shardlm train: error: a micro-batch of 4 x 1,000,000 tokens (train.micro_batch_size "
                               "x train.seq_len) needs about ") and "and cpu has 8.0 GiB free: lower train.seq_len" \
        in lines[0], lines
    assert not (tmp_path / "new").exists()

    def oom(*args):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 800000000000 bytes.")
    monkeypatch.setattr(cli, "_train", oom)
    status, lines = _cli(argv, capsys)
    assert status == 1 and len(lines) == 1 and "lower train.seq_len (1,000,000) or train.micro_batch_size (4)" in \
        lines[0], lines
