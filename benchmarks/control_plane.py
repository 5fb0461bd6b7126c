"""Control-plane cost per request at queue depths 10, 1k and 100k; prints JSON.

Same as ``diffusion-runtime bench control-plane``.
"""

import json

from diffusion_runtime.bench.control_plane import run

if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
