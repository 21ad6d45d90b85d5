"""`eager(fn)`: fn runs outside any compiled graph, as under `torch.compiler.disable`, with torch's compiler
(torch._dynamo) imported when fn is first called rather than when its module is imported. Importing the
compiler costs a process about a second (1.1 s of a CPU `shardlm train tiny`'s 3.2 s), which a run that never
compiles need not pay. torch's own modules use the same lazy form (`torch._disable_dynamo`: private, so
taken where the installed torch has it)."""
from __future__ import annotations

import torch

eager = getattr(torch, "_disable_dynamo", None) or torch.compiler.disable
