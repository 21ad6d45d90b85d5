"""The package's layering (docs/architecture.md): imports point down, never in a cycle, and every module
imports on its own."""
import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Bottom to top. A module imports modules of lower layers, or of its own package (parallel.zero3 ->
# parallel.zero); never anything above it.
LAYERS = [
    ["naming"],                                                                                    # no imports
    ["schedules"],                                                                                 # no torch
    ["config", "cpu_adam", "sharding", "generation_config", "rng_state", "extras"],               # no shardlm imports
    ["sharded_read", "runtime"],
    ["hf_config", "kernels", "precision", "tokenizer", "metrics", "checkpoint", "flat", "runlock"],
    ["plan", "grad_norm", "data", "model", "mesh", "rundir", "checkpoint_write"],        # plan: no torch
    ["comm"],
    ["optim"],
    ["parallel"],
    ["text_metrics", "compat", "resume_notes", "adapter_check", "memory_check"],
    ["inference", "testing", "divergence", "export"],
    ["run_checkpoint", "resuming"],
    ["trainer", "serve"],                                                                         # serve: HTTP over inference
    ["cli"],
    ["__main__"],
]


def modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "shardlm").rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The shardlm modules `name` imports (functions' lazy imports included)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                out.add(target if target in known else base)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m in known and m != name}


def layer(name: str) -> int:
    if name == "shardlm":
        return 0  # the package's __init__ (its version) imports nothing of the package
    top = name.split(".")[1]
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    return len(LAYERS)


def test_imports_point_down_and_form_no_cycle():
    mods = modules()
    graph = {name: imports(name, path, set(mods)) for name, path in mods.items()}
    unplaced = [m for m in mods if m != "shardlm" and layer(m) == len(LAYERS)]
    assert not unplaced, f"place these modules in a layer: {unplaced}"
    assert not graph["shardlm"], graph["shardlm"]
    upward = [(m, d) for m, deps in graph.items() for d in deps if d != "shardlm"
              and (layer(d) > layer(m) or (layer(d) == layer(m) and d.split(".")[1] != m.split(".")[1]))]
    assert not upward, f"imports that do not point down: {upward}"
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for dep in graph[node]:
            assert state.get(dep) != "open", "import cycle: " + " -> ".join(stack + [dep])
            if dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"
    for m in graph:
        if m not in state:
            visit(m, [m])


def test_every_module_imports_on_its_own():
    """Each module imported first, into an interpreter that holds no other shardlm module (torch stays
    loaded, so this takes seconds; two interpreters at once, each taking every other module): an import
    cycle that only shows in some import order fails here."""
    names = sorted(m for m in modules() if not m.endswith("__main__"))
    procs = []
    for share in (names[0::2], names[1::2]):
        code = ("import importlib, sys, torch\n"
                f"for name in {share!r}:\n"
                "    for m in [m for m in sys.modules if m == 'shardlm' or m.startswith('shardlm.')]:\n"
                "        del sys.modules[m]\n"
                "    importlib.import_module(name)\n")
        procs.append(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    try:
        for proc in procs:
            err = proc.communicate(timeout=240)[1]
            assert proc.returncode == 0, err[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_the_planner_and_the_config_import_no_torch():
    code = ("import sys, shardlm.config, shardlm.hf_config, shardlm.plan.cli, shardlm.plan.search, shardlm.schedules\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_training_or_generation_that_compiles_nothing_never_imports_the_compiler(tmp_path):
    """Importing torch._dynamo costs a process about a second (a third of a CPU `shardlm train tiny`): modules
    mark their eager functions lazily (model/lazy_compiler.py) and the model is built on the meta device
    without torch's random init (model/meta_init.py), each of which imported it before; an eager engine
    marks no dynamic size, and ZeRO's hooks are disabled for the compiler only where blocks compile."""
    from helpers import TEXT
    (tmp_path / "text.txt").write_text(TEXT * 4)
    code = ("import sys\nfrom shardlm.cli import main\n"
            f"assert main(['data', 'prepare', '--input', {str(tmp_path / 'text.txt')!r}, '--tokenizer', 'byte', "
            f"'--out', {str(tmp_path / 'data')!r}]) == 0\n"
            f"assert main(['train', 'tiny', '--train.steps', '2', '--data.path', {str(tmp_path / 'data')!r}, '--out', "
            f"{str(tmp_path / 'run')!r}, '--train.tensorboard', 'false', '--train.device', 'cpu']) == 0\n"
            f"assert main(['generate', '--model', {str(tmp_path / 'run')!r}, '--prompt', 'the', "
            "'--max-new-tokens', '3', '--device', 'cpu']) == 0\n"
            "assert 'torch._dynamo' not in sys.modules, 'the compiler was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
