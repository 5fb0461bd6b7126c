"""Low-rank adapters (LoRA): the file format, the batched layers, the worker's
store and the core's table of loaded adapters (``docs/lora.md``).

:class:`~diffusion_runtime.lora_request.LoRARequest` lives one layer lower,
beside :class:`~diffusion_runtime.SamplingParams`, which carries it.
"""
