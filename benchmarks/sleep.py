"""Sleep and wake latency at both levels, memory freed, and the first request after a
wake against a warm one; prints JSON.

Same as ``diffusion-runtime bench sleep``.
"""

import json

from diffusion_runtime.bench.sleep import run

if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
