"""Digits throughput with the online auditor and with a trace, against neither; prints JSON.

Same as ``diffusion-runtime bench audit``.
"""

import json

from diffusion_runtime.bench.audit import run

if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
