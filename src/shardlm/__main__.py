"""`python -m shardlm` (and `torchrun ... -m shardlm train ...`), and the `shardlm` command's entry point."""
import sys


def run() -> int:
    try:
        from .cli import main  # the config's modules: a few tenths of a second on a slow machine
    except KeyboardInterrupt:  # Ctrl-C then printed a traceback through them
        print("shardlm: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    return main()


if __name__ == "__main__":
    sys.exit(run())
