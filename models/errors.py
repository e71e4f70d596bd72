class UserError(Exception):
    """An expected user mistake: its message names the problem and the fix."""
