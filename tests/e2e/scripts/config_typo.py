"""A script written for DeepSpeed (``import deepspeed``) whose config has a typo: under the ``deepshard``
launcher every rank stops at initialize with the same config error."""
import torch

import deepspeed

print(f"import deepspeed -> {deepspeed.__name__} from {deepspeed.__file__}", flush=True)
model = torch.nn.Linear(4, 4)
deepspeed.initialize(model=model, model_parameters=model.parameters(),
                     config={"train_batch_size": 2, "zero_optimization": {"stgae": 2}})
