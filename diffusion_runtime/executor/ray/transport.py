"""Wave outputs through Ray's object store.

The output rank returns a :class:`WaveReply`: the runner output without its
tensors, plus each tensor as a NumPy array. Ray stores NumPy arrays out of
band, so a large image is written into the object store once and read here as
a view of shared memory, then copied once into a private tensor (the store's
memory is freed when the reply is dropped).
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from diffusion_runtime.contracts import RunnerOutput

# A tensor NumPy cannot hold (bfloat16) travels pickled, as a tensor.
Payload = np.ndarray | torch.Tensor


@attrs.frozen
class WaveReply:
    """What the output rank returns for one wave."""

    output: RunnerOutput
    tensors: dict[str, dict[str, Payload]]

    @classmethod
    def pack(cls, output: RunnerOutput) -> WaveReply:
        tensors = {
            field: {rid: _to_payload(t) for rid, t in by_id.items()}
            for field, by_id in output.tensor_fields().items()
        }
        return cls(output.without_tensors(), tensors)

    def unpack(self) -> RunnerOutput:
        """The runner output, each tensor a private copy."""
        return self.output.with_tensors(
            {
                field: {rid: _to_tensor(payload) for rid, payload in by_id.items()}
                for field, by_id in self.tensors.items()
            }
        )


def _to_payload(tensor: torch.Tensor) -> Payload:
    if tensor.dtype == torch.bfloat16:
        return tensor
    return tensor.detach().contiguous().numpy()


def _to_tensor(payload: Payload) -> torch.Tensor:
    if isinstance(payload, torch.Tensor):
        return payload
    return torch.from_numpy(np.array(payload, copy=True))
