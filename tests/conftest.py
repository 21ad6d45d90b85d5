import os

# Inductor compiles in a pool of fresh interpreters (each importing torch: 2.5 CPU-s here) in every process that
# compiles, the suite's ranks included; on a 2-core machine they only take cores from the ranks.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Keep the suite deterministic and light on a 2-core CI machine.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    # The embedded default corpus is cached under XDG_CACHE_HOME; share one per session.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "cache"))
