"""The checks of a file a command reads as its input (eval's --data, generate's --input), made before a model
loads: a directory, a missing file, a pipe or a device, a file the user may not read, each named in one line."""
from __future__ import annotations

from pathlib import Path

from .errors import ConfigError


def input_file(path: Path, flag: str) -> None:
    """Refuse `path`, given as `flag`, unless it is a regular file this process may read."""
    if path.is_dir():
        # `data prepare`'s output is what a fine-tuning user holds after training on it.
        prepared = ("; it is a prepared dataset, which eval does not read: name it as a run's data.eval_path to "
                    "score it during training, or give eval a text file") if (path / "index.json").is_file() else ""
        raise ConfigError(f"{flag} {path} is a directory, not a file{prepared}")
    if not path.is_file():
        raise ConfigError(f"{flag} {path}: {not_a_file(path)}")
    try:  # before the model loads; unread, a PermissionError's traceback came after it
        with open(path, "rb"):
            pass
    except OSError as e:
        raise ConfigError(f"{flag} {path} cannot be read: {e.strerror or e}") from None


def not_a_file(path: Path) -> str:
    """Why `path`, neither a file nor a directory, cannot be read: a shell's <(...) is a pipe that exists."""
    if path.exists():
        return "not a regular file (a pipe, as the shell's <(...) gives, or a device): write it to a file and give that"
    return "no such file"
