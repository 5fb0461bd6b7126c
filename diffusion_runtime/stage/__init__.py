"""An engine core in a child process behind ZMQ (see ``docs/stage.md``).

Modules, one job each: :mod:`.client` (:class:`StageClient`, the asyncio front),
:mod:`.process` (spawning, the start-up handshake and stopping, client side),
:mod:`.proc` (the stage process: one loop driving the core), :mod:`.messages`
(the typed protocol), :mod:`.codec` (runtime objects to messages and back),
:mod:`.batch` (a batch request's parent and its lifecycle), :mod:`.allow_list`
(which RPC methods may be called), :mod:`.endpoints` (socket addresses, frame
limits and the private socket directory), :mod:`.security` (CURVE
authentication of TCP sockets).
"""

from diffusion_runtime.stage.client import StageClient
from diffusion_runtime.stage.errors import StageProtocolError, StageStartError

__all__ = ["StageClient", "StageProtocolError", "StageStartError"]
