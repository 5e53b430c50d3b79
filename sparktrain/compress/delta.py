"""``delta+<c>``: send the change of a value the receiver already holds.

For repeated sends of slowly changing values — parameter server pulls, parameters
pushed again and again — the difference to the last value the receiver reconstructed is
small and compresses well. Sender and receiver each keep a reference in their own
:class:`BucketState` (slot ``delta.ref``), both starting at zero:

- sender: ``d = x - ref``; send ``C(d)``; ``ref += D(C(d))`` (the sender mirrors the
  receiver, so compression error never accumulates: the next delta re-sends it);
- receiver: :meth:`Delta.receive` does ``ref += D(payload)`` and returns ``ref``.

Both sides apply the same decoded bytes with the same ops, so their references stay
bitwise equal. ``decompress`` alone returns only the delta. Gradients are not such
values: ring/tree reject ``delta`` (see ``sparktrain.config``).
"""

from __future__ import annotations

import torch

from sparktrain.compress.base import BaseCompressor, BucketState, Compressor, Ctx, Payload

REFERENCE = "delta.ref"


class Delta(BaseCompressor):
    summable = False

    def __init__(self, inner: Compressor) -> None:
        self.inner = inner
        self.spec = "delta" if inner.spec == "none" else f"delta+{inner.spec}"

    @staticmethod
    def _ref(state: BucketState, numel: int) -> torch.Tensor:
        ref = state.slots.get(REFERENCE)
        if ref is None or ref.numel() != numel:
            ref = torch.zeros(numel, dtype=torch.float32)
            state.slots[REFERENCE] = ref
        return ref

    def compress(self, tensor: torch.Tensor, state: BucketState) -> tuple[Payload, Ctx]:
        t = tensor.detach().reshape(-1).to(torch.float32)
        ref = self._ref(state, t.numel())
        payload, ctx = self.inner.compress(t - ref, state)
        self.inner.add_into(ref, payload, ctx)
        return payload, ctx

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        return self.inner.decompress(payload, ctx)

    def receive(self, payload: Payload, ctx: Ctx, state: BucketState) -> torch.Tensor:
        """Receiver side: apply the delta to this receiver's reference and return it."""
        ref = self._ref(state, ctx.numel)
        self.inner.add_into(ref, payload, ctx)
        return ref

    def payload_nbytes(self, numel: int) -> int:
        return self.inner.payload_nbytes(numel)
