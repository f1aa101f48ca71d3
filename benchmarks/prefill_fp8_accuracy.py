"""The model's prefill precision end to end: `prefill_fp8="auto"` (fp8 Q/K/V in the dense
prefill where the GPU has fp8 matrix units) against "off" (bf16), same weights, same
prompts, greedy decode with the bf16 model's picks fed to both; transformers' float32
forward as the exact answer. Prints one JSON object per configuration. Usage (GPU,
repository root):

    PYTHONPATH=. python3 benchmarks/prefill_fp8_accuracy.py [steps]
"""
import json
import sys

import torch

from graphsafe.models import build_demo_model
from graphsafe.models.precision import compare_decoding

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 32
# DeepSeek-V3.2's per-head shapes; index_topk 2048 so every prompt below takes the dense
# (flash_attn_varlen) prefill, the path the setting changes.
SHAPES = dict(
    hidden_size=1024, intermediate_size=2048, num_attention_heads=16, q_lora_rank=384, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64, index_head_dim=128,
    index_topk=2048, vocab_size=2048, max_model_len=2304, block_size=64, max_batch=8,
)
for layers, lengths in ((2, [2000, 1024, 512, 100]), (4, [2000, 1500, 700, 64])):
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, SHAPES["vocab_size"], (n,), generator=g).tolist() for n in lengths]
    bf16, hf = build_demo_model("cuda", torch.bfloat16, seed=3, num_hidden_layers=layers, prefill_fp8="off", **SHAPES)
    fp8, _ = build_demo_model("cuda", torch.bfloat16, seed=3, num_hidden_layers=layers, prefill_fp8="auto",
                              with_hf=False, **SHAPES)
    oracle = hf.float().to("cuda") if hf is not None else None
    result = compare_decoding(bf16, fp8, prompts, steps, oracle=oracle)
    print(json.dumps({"layers": layers, "prompt_lengths": lengths, "steps": steps,
                      "device": torch.cuda.get_device_name(), **result}), flush=True)
    del bf16, fp8, hf, oracle
    torch.cuda.empty_cache()
