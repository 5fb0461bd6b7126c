"""An OpenAI-compatible images HTTP API over an engine, with Prometheus metrics.

Needs the ``serve`` extra (``pip install 'diffusion-runtime[serve]'``). See
``docs/serving.md``.
"""

from diffusion_runtime.serving.app import build_app
from diffusion_runtime.serving.config import ServerConfig
from diffusion_runtime.serving.metrics import EngineMetrics
from diffusion_runtime.serving.server import ServerThread, serve

__all__ = ["EngineMetrics", "ServerConfig", "ServerThread", "build_app", "serve"]
