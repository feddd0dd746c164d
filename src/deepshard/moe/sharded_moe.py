"""``deepspeed.moe.sharded_moe``: the gate and layer classes under DeepSpeed's module path
(``TopKGate``, ``MOELayer``). deepshard's gate returns sparse routes (``deepshard.moe.gate.Routing``)
where DeepSpeed's returned dense combine and dispatch tensors."""
from deepshard.moe.gate import TopKGate
from deepshard.moe.layer import MOELayer

__all__ = ["MOELayer", "TopKGate"]
