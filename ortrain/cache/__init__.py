"""``ORTMODULE_CACHE_DIR``: exported graphs kept across processes (see the README's *Start-up*)."""
