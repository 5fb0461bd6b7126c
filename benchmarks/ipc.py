"""IPC costs of the mp executor: control round trip, one 512x512 image through shared memory
against a pickling queue, uni vs mp engine throughput, death detection; prints JSON.

Same as ``diffusion-runtime bench ipc``.
"""

import json

from diffusion_runtime.bench.ipc import run

if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
