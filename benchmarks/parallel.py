"""One rank against CFG-parallel ranks: images/s, the ratio and CPU seconds; prints JSON.

Same as ``diffusion-runtime bench parallel``.
"""

import json

from diffusion_runtime.bench.parallel import run

if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
