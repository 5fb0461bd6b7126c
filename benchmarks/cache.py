"""TeaCache on digits: skipped steps, images/s and recognition over thresholds; prints JSON.

Same as ``diffusion-runtime bench cache``.
"""

import json

from diffusion_runtime.bench.cache import run

if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
