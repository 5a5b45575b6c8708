def register() -> None:
    """Placeholder replaced below."""
