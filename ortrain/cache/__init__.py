"""``ORTMODULE_CACHE_DIR``: captures and exported graphs kept across processes (see the README's
*Start-up*): ``capture_key`` / ``cached_capture`` for captures, ``graph_key`` / ``cached_export``
for exports, ``store`` for the directory both share."""
