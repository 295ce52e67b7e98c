"""The one piece of global state every hook reads: the active recorder, or None.

Hooks elsewhere (the op ledger, the RPC agent, record_function) test `state.recorder is None`
first, so a process that is not profiling pays one attribute read per hook.
"""

from __future__ import annotations

from typing import Optional

from shoal.core.profiler.events import Recorder

recorder: Optional[Recorder] = None
