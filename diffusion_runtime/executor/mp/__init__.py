"""The ``mp`` backend: one worker process per device (see ``docs/executors.md``).

Modules, one job each: :mod:`.executor` (the executor), :mod:`.group` (the
processes, their pipes and the start-up handshake), :mod:`.worker_proc` (the
worker process's main loop), :mod:`.messages` (what crosses the pipes),
:mod:`.remote_error` (exceptions across processes), :mod:`.segments`
(shared-memory image transport), :mod:`.calls` (matching replies to callers),
:mod:`.pump` (the result reader thread), :mod:`.monitor` (death detection),
:mod:`.wakeup` (waking those two threads), :mod:`.spec` (what a worker is
started with).
"""

from diffusion_runtime.executor.mp.executor import MultiprocExecutor
from diffusion_runtime.executor.mp.group import WorkerStartError

__all__ = ["MultiprocExecutor", "WorkerStartError"]
