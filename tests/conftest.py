import os

import pytest
import torch

# Keep the suite deterministic and light on a 2-core CI machine.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    # The embedded default corpus is cached under XDG_CACHE_HOME; share one per session.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "cache"))
