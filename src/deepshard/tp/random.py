"""Random streams for dropout under tensor parallelism.

Inside a tensor-parallel region each rank holds different activations (its heads, its slice of the MLP),
so their dropout masks must differ: Megatron seeds that stream with ``seed + 2718 + tp_rank``. Outside,
the activations are replicated and every tensor-parallel rank must drop the same elements: the default
generator, seeded identically on every rank, serves there. With sequence parallelism the norms and
dropouts outside the regions see different sequence shards, so they use the per-rank stream too.

``RngTracker`` keeps named generator states and swaps one in for the duration of a ``with
tracker.fork():`` block (the default generator is restored afterwards), so any op (``F.dropout``,
``torch.rand``) draws from it. It is an object owned by the model, not global state.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

TP_SEED_OFFSET = 2718  # Megatron's offset for the tensor-parallel stream
TP_STREAM = "tensor-parallel"


class RngTracker:
    """Named random streams on one device type (``cpu`` or ``cuda``)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._states: dict[str, torch.Tensor] = {}

    def _get(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed`` (the default generator is left as it was)."""
        if name in self._states:
            raise ValueError(f"random stream {name!r} already exists; use another name or a new tracker")
        saved = self._get()
        gen_seed = torch.Generator(device=self.device).manual_seed(seed)
        self._set(gen_seed.get_state())
        self._states[name] = self._get()
        self._set(saved)

    @contextlib.contextmanager
    def fork(self, name: str = TP_STREAM) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; its state advances, the default one does not."""
        if name not in self._states:
            raise KeyError(f"random stream {name!r} does not exist; known: {sorted(self._states)}")
        saved = self._get()
        self._set(self._states[name])
        try:
            yield
        finally:
            self._states[name] = self._get()
            self._set(saved)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every stream's generator state, by name (what a checkpoint keeps)."""
        return {name: state.clone() for name, state in self._states.items()}

    def load_state_dict(self, states: dict[str, torch.Tensor]) -> None:
        """Set the streams named in ``states`` to those generator states (other streams are left as they are)."""
        for name, state in states.items():
            self._states[name] = state.clone()


def tensor_parallel_rng(seed: int, tp_rank: int, device: torch.device | str = "cpu") -> RngTracker:
    """A tracker whose ``tensor-parallel`` stream is seeded ``seed + 2718 + tp_rank`` (Megatron)."""
    tracker = RngTracker(device)
    tracker.add(TP_STREAM, seed + TP_SEED_OFFSET + tp_rank)
    return tracker
