"""What the command lines turn into one line and an exit code instead of a traceback, and `run`, which does it."""

import logging
import sys
from typing import Callable


class UserError(Exception):
    """A problem in what the user gave us (config, data, checkpoint), with the fix in its message: exit 2."""


class ConfigError(UserError):
    pass


class DataError(UserError):
    pass


class CheckpointError(UserError):
    pass


class ModelFileError(UserError):
    """A model directory (Hugging Face config.json, safetensors) jaxllm cannot read or would not compute exactly."""


class TrainingDiverged(UserError):
    """The loss or gradient norm stopped being finite; the message says what to try and where to resume."""


class Stopped(Exception):
    """The run stopped early on request (a signal) after saving a checkpoint it can resume from."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def run(main: Callable[[], object]) -> int:
    """Log to stderr, run `main`, turn a UserError into `error: ...` and exit code 2, a stop into `stopped: ...`:
    every `jaxllm` subcommand's, and the tools', exit code."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    for noisy in ("absl", "jax._src", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Stopped as e:
        print(f"stopped: {e}", file=sys.stderr)
        return e.exit_code
    return 0
