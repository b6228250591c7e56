"""One capture or export at a time in the process.

Capturing patches process-wide state for its duration (``torch.autograd.Function.apply``,
Hugging Face mask helpers, the exporter's loggers), and ``torch.export`` itself is not written for
concurrent use. Threads that capture different models take turns here; running graphs that are
already built never takes this lock. The patches themselves act only on the capturing thread, so
a thread that trains eagerly meanwhile is not affected.
"""

from __future__ import annotations

import threading

COMPILE_LOCK = threading.RLock()
