"""`python -m shardlm` (and `torchrun ... -m shardlm train ...`)."""
import sys

from .cli import main

sys.exit(main())
