"""User errors that are also the built-in error callers catch: a value that cannot work (ValueError), a path or
package that is not there (FileNotFoundError, ImportError). Entry points print their message alone (models/cli.py)."""

from models.errors import UserError


class ConfigError(UserError, ValueError):
    """A config or command-line value that cannot work: the message names it and a value that does."""


class MissingFileError(UserError, FileNotFoundError):
    """A path the config names does not exist: the message says how to make or pick one."""


class MissingPackageError(UserError, ImportError):
    """An optional package the config needs is not installed: the message gives the install command."""
