"""Offline vLLM with the tiered_kv connector: a multi-turn conversation whose second turn loads the
first turn's KV from the CPU tier instead of recomputing it.

Needs a CUDA machine with vLLM 0.26-0.33 and tiered_kv installed in the same environment.
Run:  PYTHONHASHSEED=0 python examples/vllm_offline.py /path/to/model   (a dummy-weight config dir works:
      the script falls back to load_format="dummy" when the directory has no weights)
"""
import os
import sys
import time

os.environ.setdefault("PYTHONHASHSEED", "0")  # stable block hashes, so the disk tier hits after a restart

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

model = sys.argv[1] if len(sys.argv) > 1 else "meta-llama/Meta-Llama-3-8B-Instruct"
has_weights = not os.path.isdir(model) or any(f.endswith((".safetensors", ".bin")) for f in os.listdir(model))
llm = LLM(
    model=model,
    load_format="auto" if has_weights else "dummy",
    skip_tokenizer_init=not has_weights,
    enable_prefix_caching=True,
    num_gpu_blocks_override=1024,            # a small GPU cache, so turn 2 must come from our tiers
    kv_transfer_config=KVTransferConfig(
        kv_connector="TieredKVConnector",
        kv_connector_module_path="tiered_kv.connector.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"cpu_bytes": "16GiB", "disk_path": "/tmp/tiered-kv-vllm", "disk_bytes": "64GiB"},
    ),
)
greedy = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False)
conversations = [[(i * 7919 + j) % 30000 + 100 for j in range(6000)] for i in range(4)]  # 4 x 6k-token prompts


def ttft(tokens):
    t = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": tokens}], SamplingParams(max_tokens=1, temperature=0.0,
                                                                       detokenize=False), use_tqdm=False)[0]
    return time.perf_counter() - t, out.num_cached_tokens


for c in conversations:                       # turn 1: computed, stored below the GPU as it goes
    print("turn 1: %.3f s" % ttft(c)[0])
for c in conversations:                       # turn 2: the other conversations pushed it out of the GPU
    secs, cached = ttft(c + [42] * 64)
    print(f"turn 2: {secs:.3f} s, {cached} of {len(c) + 64} tokens not recomputed")
print(llm.generate([{"prompt_token_ids": conversations[0]}], greedy, use_tqdm=False)[0].outputs[0].token_ids)
