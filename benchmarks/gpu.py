"""The engine on a GPU against direct calls (tiny sizes without CUDA); prints JSON.

Needs the ``diffusers`` extra. ``scripts/gpu-check.sh`` runs it on a GPU machine.
"""

import json

from diffusion_runtime.bench.gpu import run

if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
