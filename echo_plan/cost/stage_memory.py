"""The memory model's result record: one pipeline stage's peak memory, by what holds it."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

GiB = float(2**30)


@dataclass(frozen=True, slots=True)
class StageMemory:
    """Peak memory of one pipeline stage's GPU, in bytes, by what holds it."""

    stage: int
    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    buffers_bytes: int
    capacity_bytes: int
    headroom_bytes: int = 0  # kept free below capacity for a plan to count as fitting (--memory-headroom)
    outside_allocator_bytes: int = 0  # of the buffers, what PyTorch's caching allocator does not hold (CUDA context, NCCL)
    # a block allocated after the peak whose size no cached segment can serve (DeepSpeed's step-end gradient copy): the
    # caching allocator reserves it beside the freed blocks it keeps, unless the GPU has no room (it then frees them)
    cached_extra_bytes: int = 0
    host_bytes: int = 0  # CPU memory this GPU's rank pins for its offloaded optimizer shard (cost/offload.py)
    host_capacity_bytes: int = 0  # its share of the server's usable CPU memory (0: nothing offloaded)

    @property
    def total_bytes(self) -> int:
        return (self.weights_bytes + self.gradients_bytes + self.optimizer_bytes
                + self.activations_bytes + self.buffers_bytes)

    @property
    def reserved_bytes(self) -> int:
        """What the caching allocator holds at the peak (``torch.cuda.max_memory_reserved``): the total less the
        CUDA context and NCCL's buffers, which it does not allocate, plus a later block no cached segment serves
        (within the capacity)."""
        held = self.total_bytes - self.outside_allocator_bytes
        return min(held + self.cached_extra_bytes, max(held, self.capacity_bytes - self.outside_allocator_bytes))

    @property
    def device_bytes(self) -> int:
        """All the GPU's memory in use at the most (what nvidia-smi shows): the allocator's reserve, the CUDA
        context and NCCL's buffers."""
        return self.reserved_bytes + self.outside_allocator_bytes

    @property
    def usable_bytes(self) -> int:
        """What a plan may use: capacity less the headroom."""
        return self.capacity_bytes - self.headroom_bytes

    @property
    def host_fits(self) -> bool:
        """The offloaded optimizer shard fits the rank's share of the server's CPU memory (true when none is)."""
        return self.host_bytes <= self.host_capacity_bytes or not self.host_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.usable_bytes and self.host_fits

    @property
    def overflow_bytes(self) -> int:
        """Bytes over the usable memory (capacity less headroom)."""
        return max(0, self.total_bytes - self.usable_bytes)

    @property
    def free_bytes(self) -> int:
        """Bytes left of the whole capacity at the peak (negative when over it)."""
        return self.capacity_bytes - self.total_bytes

    def as_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(total_gib=self.total_bytes / GiB, capacity_gib=self.capacity_bytes / GiB,
                 headroom_gib=self.headroom_bytes / GiB, free_gib=self.free_bytes / GiB, fits=self.fits,
                 host_gib=self.host_bytes / GiB, host_capacity_gib=self.host_capacity_bytes / GiB)
        return d
