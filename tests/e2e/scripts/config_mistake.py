"""A DeepSpeed script whose config (JSON, the last argument: the launcher puts --local_rank first) has a mistake deepshard finds only when it
builds the optimizer or the scheduler: under the ``deepshard`` launcher every rank stops there with the same
config error."""
import json
import sys

import torch

import deepspeed

model = torch.nn.Linear(4, 4)
deepspeed.initialize(model=model, model_parameters=model.parameters(), config=json.loads(sys.argv[-1]))
