"""A first run on a machine that lacks an optional package (pyproject.toml's extras) or a piece of the environment:
the command ends with one line naming what is missing and how to get it, a non-zero status, no traceback, and
before the work it would otherwise waste (a tokenized corpus, a loaded model, a whole generation).

A package is made missing as a user's install lacks it: None in sys.modules for it and each of its submodules
already imported, so that importing any of them raises ImportError."""
import json
import sys

import pytest

from shardlm.cli import main


def _without(monkeypatch, package: str) -> None:
    for name in [package, *(n for n in sys.modules if n.startswith(package + "."))]:
        monkeypatch.setitem(sys.modules, name, None)


def _cli(argv, capsys) -> tuple[int, str]:
    status = main([str(a) for a in argv])
    return status, capsys.readouterr().err.strip()


def test_parquet_without_pyarrow_is_named_before_any_input_is_tokenized(tmp_path, monkeypatch, capsys):
    """The ImportError escaped as a traceback, after the inputs before the parquet one had been tokenized."""
    (tmp_path / "a.txt").write_text("some text to tokenize\n")
    (tmp_path / "b.parquet").write_bytes(b"PAR1")  # never read: pyarrow is looked for first
    _without(monkeypatch, "pyarrow")
    out = tmp_path / "out"
    status, err = _cli(["data", "prepare", "--input", tmp_path / "a.txt", tmp_path / "b.parquet", "--tokenizer",
                        "byte", "--out", out], capsys)
    assert status == 2 and "\n" not in err, err
    assert err.startswith("shardlm data: error: ") and "b.parquet" in err and "pip install 'shardlm[parquet]'" in err
    assert not out.exists()


@pytest.mark.parametrize("tasks, package, name", [("bleu", "sacrebleu", "sacrebleu"),
                                                  ("bleu,rouge", "rouge_score", "rouge-score")])
def test_eval_without_its_scorer_is_named_before_the_model_loads(tasks, package, name, tmp_path, monkeypatch, capsys):
    """The scorer was imported only once every completion had been generated (minutes to hours on a large file),
    all of it thrown away; now before --model is read (it does not exist here)."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "the cat ", "completion": "sat on the mat"}) + "\n")
    _without(monkeypatch, package)
    status, err = _cli(["eval", "--model", tmp_path / "no_model", "--tasks", tasks, "--data", data], capsys)
    assert status == 2 and "\n" not in err, err
    assert f"the {name} package" in err and "pip install 'shardlm[eval]'" in err, err


def test_qlora_without_torchao_names_the_extra(tmp_path, monkeypatch, capsys):
    """It said `pip install torchao`, not the extra the README names ('shardlm[qlora]')."""
    _without(monkeypatch, "torchao")
    out = tmp_path / "run"
    status, err = _cli(["train", "tiny", "--lora.rank", "4", "--lora.quantize", "nf4", "--train.steps", "1",
                        "--train.tensorboard", "false", "--out", out], capsys)
    assert status == 2 and err.splitlines()[-1].startswith("shardlm train: error: "), err
    assert "lora.quantize = 'nf4' needs torchao: pip install 'shardlm[qlora]'" in err.splitlines()[-1], err
    assert not out.exists()


def _hf_dir(directory):
    """A tiny random model as a Hugging Face directory (byte tokenizer)."""
    from shardlm.config import load_config
    from shardlm.model import build_model
    from shardlm.model.hf import write_hf_dir
    from shardlm.tokenizer import load_tokenizer
    cfg = load_config("tiny").model
    write_hf_dir(build_model(cfg, seed=0).state_dict(), cfg, directory, load_tokenizer("byte"))
    return directory


@pytest.mark.parametrize("cmd", [["generate", "--prompt", "x"], ["serve", "--port", "0"]])
def test_a_model_directory_without_its_tokenizer_is_named_before_the_model_loads(cmd, tmp_path, monkeypatch, capsys):
    """A Hugging Face directory copied without tokenizer.json: the weights were loaded (minutes for a 7B model, the
    server's port held meanwhile) before the tokenizer was looked for."""
    import shardlm.inference.load as load
    _hf_dir(tmp_path / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "hf" / name).unlink()
    monkeypatch.setattr(load, "Decoder", lambda *a, **k: pytest.fail("the model was built"))
    status, err = _cli([cmd[0], "--model", tmp_path / "hf", *cmd[1:]], capsys)
    assert status == 2 and "\n" not in err, err
    assert f"no tokenizer.json at {tmp_path / 'hf'}; copy the tokenizer's files" in err, err


def test_an_export_that_cannot_be_written_is_named_before_the_checkpoint_is_read(tmp_path, monkeypatch, capsys):
    """--out in a read-only place: the checkpoint was read and verified whole (minutes for a 7B run's) before the
    write failed."""
    import shardlm.checkpoint as checkpoint
    from helpers import unwritable
    out = unwritable(tmp_path, "shardlm-export")
    monkeypatch.setattr(checkpoint, "load_checkpoint", lambda *a, **k: pytest.fail("the checkpoint was read"))
    status, err = _cli(["export", "--checkpoint", tmp_path / "run", "--out", out], capsys)
    assert status == 2 and "\n" not in err, err
    assert err.startswith(f"shardlm export: error: --out {out} cannot be written: "), err
    assert not out.exists()


def test_compiled_training_on_a_cpu_without_a_cxx_compiler_is_refused_before_the_run(tmp_path, monkeypatch, capsys):
    """train.compile (the gpt2-124m and llama presets set it) on a CPU with no C++ compiler, as in a slim container:
    the first step ended in Inductor's InvalidCxxCompiler traceback, after the run had claimed its --out."""
    pytest.importorskip("torch._inductor.cpp_builder")
    import torch._inductor.config as inductor
    out = tmp_path / "run"
    # torch's own patch: pytest 9.2's monkeypatch undo deletes the entry, hiding it from every later compile
    with inductor.patch({"cpp.cxx": (None, str(tmp_path / "no-such-g++"))}):
        status, err = _cli(["train", "tiny", "--train.device", "cpu", "--train.compile", "true", "--train.steps", "1",
                            "--train.tensorboard", "false", "--out", out], capsys)
    assert status == 2 and "\n" not in err, err
    assert err.startswith("shardlm train: error: train.compile = true on the CPU needs a C++ compiler") and \
        "or set train.compile false" in err, err
    assert not out.exists()


def test_serve_names_an_adapter_directory_missing_its_files_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """`serve --adapter NAME=DIR` with DIR lacking adapter_model.safetensors (a copy of adapter_config.json alone):
    the base model was loaded, minutes for a large one, before the adapter was read."""
    import shardlm.inference.load as load
    _hf_dir(tmp_path / "hf")
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4,
                                                                          "lora_alpha": 8}))
    monkeypatch.setattr(load, "Decoder", lambda *a, **k: pytest.fail("the model was built"))
    status, err = _cli(["serve", "--model", tmp_path / "hf", "--adapter", f"a={tmp_path / 'adapter'}", "--port", "0"],
                       capsys)
    assert status == 2 and "\n" not in err, err
    assert f"{tmp_path / 'adapter'} is not a readable PEFT adapter directory" in err and \
        "adapter_model.safetensors" in err, err


def test_a_hugging_face_hub_name_says_how_to_get_the_model(tmp_path, monkeypatch, capsys):
    """shardlm fetches nothing, offline (HF_HUB_OFFLINE=1) or not: a Hub name where a directory belongs said only
    'no such directory' (--model) or named a missing gpt2/config.json (train.init_from), not how to get one, as
    `data prepare --tokenizer gpt2` does."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for argv in (["generate", "--model", "meta-llama/Llama-2-7b-hf", "--prompt", "x"],
                 ["serve", "--model", "gpt2", "--port", "0"],
                 ["train", "tiny", "--train.init_from", "gpt2", "--out", tmp_path / "run"]):
        status, err = _cli(argv, capsys)
        assert status == 2 and "\n" not in err, err
        assert "for a Hugging Face Hub model, download its config.json, *.safetensors, tokenizer.json and " \
               "tokenizer_config.json into a directory and give that" in err, err
    assert not (tmp_path / "run").exists()


def test_a_broken_tensorboard_is_warned_of_and_the_run_goes_on(tmp_path, monkeypatch):
    """train.tensorboard is on by default and optional: an installed tensorboard whose import fails otherwise than
    ImportError (a protobuf its generated code predates raises TypeError) stopped every run with a traceback."""
    import types

    from shardlm.metrics import MetricsLogger

    class Broken(types.ModuleType):
        def __getattr__(self, name):
            raise TypeError("Descriptors cannot be created directly.\nIf this call came from a _pb2.py file, ...")
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", Broken("torch.utils.tensorboard"))
    said = []
    logger = MetricsLogger(tmp_path, True, True, warn=said.append)
    logger.close()
    assert len(said) == 1 and "needs tensorboard, which is installed but fails to import (TypeError: Descriptors " \
        "cannot be created directly.)" in said[0] and "train.tensorboard false" in said[0], said
    assert not list(tmp_path.glob("tensorboard/events.*"))
    said.clear()
    MetricsLogger(tmp_path, True, False, warn=said.append).close()
    assert not said


# (the package as imported, what its import raises, the command that needs it, pip's name for it)
BROKEN = [
    ("sacrebleu", "ImportError('libsacre.so: cannot open shared object file\\nmore')",
     ["eval", "--model", "{tmp}/no_model", "--tasks", "bleu", "--data", "{jsonl}"], "sacrebleu"),
    ("rouge_score", "AttributeError(\"module 'numpy' has no attribute 'float'\")",
     ["eval", "--model", "{tmp}/no_model", "--tasks", "rouge", "--data", "{jsonl}"], "rouge-score"),
    ("pyarrow", "ImportError('libarrow.so.1700: cannot open shared object file')",
     ["data", "prepare", "--input", "{parquet}", "--tokenizer", "byte", "--out", "{tmp}/out"], "pyarrow"),
    ("torchao", "OSError('libtorchao.so: undefined symbol: _ZN3c10')",
     ["train", "tiny", "--lora.rank", "4", "--lora.quantize", "nf4", "--train.steps", "1", "--train.tensorboard",
      "false", "--data.path", "{data}", "--out", "{tmp}/run"], "torchao"),
    ("fastapi", "ModuleNotFoundError(\"No module named 'starlette'\", name='starlette')",
     ["serve", "--model", "{tmp}/no_model", "--port", "0"], "fastapi"),
]


def _broken(root, package: str, raised: str) -> dict:
    """An environment whose `package` is installed but raises `raised` when imported (a missing shared library, a
    dependency of another version): a directory holding it, first on PYTHONPATH."""
    import os
    (root / "site" / package).mkdir(parents=True)
    (root / "site" / package / "__init__.py").write_text(f"raise {raised}\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "site"), *sys.path])}


def _prepared(root):
    from helpers import TEXT
    (root / "text.txt").write_text(TEXT * 4)
    assert main(["data", "prepare", "--input", str(root / "text.txt"), "--tokenizer", "byte", "--out",
                 str(root / "data")]) == 0
    return root / "data"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("package, raised, argv, pip", BROKEN, ids=[b[0] for b in BROKEN])
def test_a_broken_optional_package_is_named_as_broken_in_one_line(package, raised, argv, pip, tmp_path):
    """An optional package installed but failing to import was called not installed (where its error was an
    ImportError: pip install then did nothing) or ended in a traceback (any other error)."""
    from helpers import run_cli
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "the cat ", "completion": "sat on the mat"}) + "\n")
    (tmp_path / "b.parquet").write_bytes(b"PAR1")
    names = {"tmp": tmp_path, "jsonl": tmp_path / "d.jsonl", "parquet": tmp_path / "b.parquet",
             "data": _prepared(tmp_path) if package == "torchao" else ""}
    proc = run_cli(*[a.format(**names) for a in argv], check=False, env=_broken(tmp_path, package, raised), timeout=50)
    err = [line for line in proc.stderr.strip().splitlines() if not line.startswith(("tokenize:", "W1", "WARNING"))]
    assert proc.returncode == 2 and len(err) == 1 and "Traceback" not in proc.stderr, proc.stderr
    kind, _, why = raised.partition("(")
    first = eval(raised).args[0].splitlines()[0]
    assert err[0].startswith(f"shardlm {argv[0]}: error: ") and f"needs {pip}, which is installed but fails to import " \
        f"({kind}: {first}); reinstall it: pip install --force-reinstall {pip}" in err[0], err[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "run").exists()


@pytest.mark.timeout(60)
def test_a_broken_tensorboard_is_named_as_broken_and_the_run_goes_on(tmp_path):
    """tensorboard installed but raising ImportError at import (a missing shared library) was called not installed,
    and `pip install tensorboard`, what that warning said to do, does nothing where it is installed."""
    from helpers import run_cli
    env = _broken(tmp_path, "tensorboard", "ImportError('_pywrap_tensorflow.so: cannot open shared object file')")
    proc = run_cli("train", "tiny", "--train.steps", "1", "--train.sample_tokens", "0", "--data.path",
                   _prepared(tmp_path), "--out", tmp_path / "run", env=env, timeout=50)
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "TensorBoard" in line]
    assert len(said) == 1 and said[0].startswith("warning: no TensorBoard events will be written: train.tensorboard "
                                                 "needs tensorboard, which is installed but fails to import "
                                                 "(ImportError: _pywrap_tensorflow.so: cannot open shared object "
                                                 "file); reinstall it: pip install --force-reinstall tensorboard, "
                                                 "or set train.tensorboard false"), proc.stdout + proc.stderr
    assert (tmp_path / "run" / "checkpoints" / "step_00000001").is_dir()
