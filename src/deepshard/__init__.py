"""deepshard: ZeRO-sharded, mixed-precision, multi-process training for PyTorch.

Keeps DeepSpeed's public contract, so ``import deepshard as deepspeed`` runs a DeepSpeed user's script::

    engine, optimizer, dataloader, lr_scheduler = deepshard.initialize(args=args, model=model,
                                                                       model_parameters=model.parameters())
    loss = engine(batch); engine.backward(loss); engine.step()
"""
from deepshard.config import DeepShardConfig, add_config_arguments, load_config
from deepshard.distributed import init_distributed
from deepshard.engine import DeepShardEngine
from deepshard.initialize import initialize

__version__ = "0.1.0"
version = __version__

# DeepSpeed's class name, for isinstance checks in user code.
DeepSpeedEngine = DeepShardEngine

__all__ = ["DeepShardConfig", "DeepShardEngine", "DeepSpeedEngine", "__version__", "add_config_arguments",
           "init_distributed", "initialize", "load_config"]
