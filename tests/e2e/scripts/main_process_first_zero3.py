"""A ZeRO-3 model built inside ``accelerator.main_process_first()`` (accelerate #3709): with real DeepSpeed
every rank hangs; on deepshard rank 0 must fail at once, naming the cause."""
from accelerate import Accelerator, DeepSpeedPlugin
from transformers import AutoModelForCausalLM, LlamaConfig

accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3, zero3_init_flag=True))
config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=2)
with accelerator.main_process_first():
    model = AutoModelForCausalLM.from_config(config)
print("built inside main_process_first", flush=True)
