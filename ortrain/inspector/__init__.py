"""Runtime inspector: how sparse the training data is, and how much memory each step phase holds."""
