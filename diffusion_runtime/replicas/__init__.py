"""Data-parallel replicas: N engines in Ray actors behind one front (see ``docs/distributed.md``).

Modules: :mod:`.config` (what a replica set is built from), :mod:`.replica`
(the actor hosting one engine), :mod:`.router` (choosing a replica by load),
:mod:`.heartbeat` (load reports and death detection), :mod:`.front` (the
engine-like API over the replicas).
"""

from diffusion_runtime.replicas.config import ROUTING_POLICIES, ReplicaSetConfig
from diffusion_runtime.replicas.front import ReplicaSet, ReplicaSetSnapshot

__all__ = ["ROUTING_POLICIES", "ReplicaSet", "ReplicaSetConfig", "ReplicaSetSnapshot"]
