"""Keep the garbage collector's full passes short in the long-lived serving processes.

A process that has imported torch, transformers and FastAPI and built a model tracks some
300,000 objects at start-up (SmolLM2's engine process: ~310,000). CPython's oldest-generation
pass walks all of them (hundreds of milliseconds on a 2-core machine, docs/serving.md),
and it runs whenever enough new objects have survived: now and then one engine step, and
with it the TTFT of whatever prefills in that step, pays for it. None of the start-up objects is ever
garbage, so once start-up is over they are moved to the permanent generation
(``gc.freeze``), which no pass walks; later passes see only what serving allocates.
vLLM does the same in its engine core and API server.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect what start-up left behind, then move every surviving object to the permanent
    generation. Returns how many objects the permanent generation then holds."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
