"""Errors a user can fix: the CLI prints them as one line and exits 2."""


class UserError(Exception):
    """A problem in what the user gave us (config, data, checkpoint), with the fix in its message."""


class ConfigError(UserError):
    pass


class DataError(UserError):
    pass


class CheckpointError(UserError):
    pass
