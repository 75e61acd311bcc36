"""What the command lines turn into one line and an exit code instead of a traceback."""


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
