"""What a replica set is built from. Every field is validated on construction."""

from __future__ import annotations

from typing import Any

import attrs

from diffusion_runtime.config import EngineConfig
from diffusion_runtime.validation import fail, finite_in_range, int_in_range, one_of

ROUTING_POLICIES = ("power_of_two", "least_loaded")


def _is_engine_config(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, EngineConfig):
        fail(instance, attribute.name, "must be an EngineConfig", type(value).__name__)


def _is_optional_address(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not (isinstance(value, str) and value.strip()):
        fail(instance, attribute.name, "must be a Ray address ('auto', 'host:port') or None", value)


@attrs.frozen
class ReplicaSetConfig:
    """``num_replicas`` engines, each built from ``engine`` in its own Ray actor.

    Each replica actor reserves ``replica_cpus`` CPUs (and ``replica_gpus``
    GPUs); ``engine`` decides how the replica runs its workers (``uni`` in the
    actor, or ``mp`` processes beside it). Requests go to the replica with
    the least load (``"least_loaded"``) or the less loaded of two drawn at
    random (``"power_of_two"``). Every ``heartbeat_interval_s`` each replica
    reports its load; one that does not answer within ``heartbeat_timeout_s``
    (or whose actor died) is dead. ``ray_address`` is as in :class:`EngineConfig`.
    """

    engine: EngineConfig = attrs.field(validator=_is_engine_config)
    num_replicas: int = attrs.field(default=2, validator=int_in_range(1, 4096))
    routing: str = attrs.field(default="power_of_two", validator=one_of(*ROUTING_POLICIES))
    replica_cpus: float = attrs.field(default=1.0, validator=finite_in_range(0.0, 1024.0))
    replica_gpus: float = attrs.field(default=0.0, validator=finite_in_range(0.0, 1024.0))
    heartbeat_interval_s: float = attrs.field(default=0.5, validator=finite_in_range(0.01, 3_600.0))
    heartbeat_timeout_s: float = attrs.field(default=10.0, validator=finite_in_range(0.1, 3_600.0))
    start_timeout_s: float = attrs.field(default=300.0, validator=finite_in_range(0.1, 86_400.0))
    ray_address: str | None = attrs.field(default=None, validator=_is_optional_address)
