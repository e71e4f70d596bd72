"""The base class of the errors a user can fix from their message alone (no traceback needed)."""


class UserError(Exception):
    """An expected user mistake: its message names the problem and the fix."""
