"""A small DeepSeek-V3.2-style model built on graphsafe's ops (demo, tests, benchmarks).

    from graphsafe.models import DeepseekV32Model, ModelConfig, build_demo_model

    model, hf_model = build_demo_model("cuda", torch.bfloat16, seed=0)
    state = model.new_state()
    logits = model.prefill(state, [[1, 2, 3], [4, 5]])     # last-token logits [2, vocab]
    tokens = logits.argmax(-1)
    for _ in range(16):
        inputs = model.decode_inputs(state, tokens)         # DecodeInputs, no host sync
        logits = model.decode_step(inputs)                  # compiles fullgraph, captures
        model.advance(state, tokens)
        tokens = logits.argmax(-1)

Tensor parallelism (one process per rank, e.g. under torchrun; see `models.parallel`):

    tp = TensorParallel.from_process_group()             # after init_process_group
    model, _ = build_demo_model(device, tp=tp)           # this rank's shard
"""

from graphsafe.models.config import ModelConfig
from graphsafe.models.demo import DEMO_HF_CONFIG, build_demo_model, build_hf_model, demo_hf_config
from graphsafe.models.model import DeepseekV32Model
from graphsafe.models.parallel import TensorParallel
from graphsafe.models.state import HostState
from graphsafe.models.weights import convert_state_dict, hf_param_shapes, random_hf_state_dict

__all__ = [
    "DEMO_HF_CONFIG",
    "DeepseekV32Model",
    "HostState",
    "ModelConfig",
    "TensorParallel",
    "build_demo_model",
    "build_hf_model",
    "convert_state_dict",
    "demo_hf_config",
    "hf_param_shapes",
    "random_hf_state_dict",
]
