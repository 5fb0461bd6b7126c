"""The ``ray`` backend: one Ray actor per worker rank (see ``docs/distributed.md``).

Modules, one job each: :mod:`.executor` (the executor), :mod:`.connection`
(joining or starting Ray), :mod:`.group` (the placement group and the
actors), :mod:`.actor` (the body of a worker actor), :mod:`.transport` (wave
outputs through the object store), :mod:`.waves` (request ids of waves in
flight), :mod:`.liveness` (the ping that bounds how long a silent worker is
trusted), :mod:`.failures` (Ray's errors as the runtime's).
"""

from diffusion_runtime.executor.ray.executor import RayExecutor

__all__ = ["RayExecutor"]
