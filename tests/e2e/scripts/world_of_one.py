"""e2e helper: init_distributed() in a plain python process (no launcher env) gives a world of 1."""
import torch
import torch.distributed as dist

try:
    from deepshard import init_distributed
except ImportError:  # the package's public __init__ may not re-export it yet
    from deepshard.distributed import init_distributed

init_distributed()
value = torch.tensor([5.0])
dist.all_reduce(value)
print(f"world_size={dist.get_world_size()} rank={dist.get_rank()} backend={dist.get_backend()} "
      f"sum={value.item()}", flush=True)
dist.destroy_process_group()
