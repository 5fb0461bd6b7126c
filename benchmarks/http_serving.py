"""HTTP vs in process at 16 concurrent clients on digits: throughput, p50 and p99; prints JSON.

Same as ``diffusion-runtime bench http``. Needs the ``serve`` extra.
"""

import json

from diffusion_runtime.bench.http import run

if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
