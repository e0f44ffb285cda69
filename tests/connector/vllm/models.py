"""Tiny hybrid and MLA models for the connector tests: HF configs plus the KV cache spec of each layer.

No model is instantiated on a CPU, so each layer's ``KVCacheSpec`` is written here the way
vLLM's attention layers report it (``Attention.get_kv_cache_spec``: a ``SlidingWindowSpec`` for
sliding-window layers, else ``FullAttentionSpec``; ``MLAAttentionSpec`` with one 576-wide latent
for MLA; a ``MambaSpec`` padded to the attention page for Mamba layers). vLLM's own
``get_kv_cache_configs`` then groups them, so the tests see the real grouping.

- ``gptoss``: gpt-oss-like, 4 layers alternating sliding window (32 tokens) and full attention:
  2 groups; with 4-block chunks of 16-token blocks a chunk stores 2 of its 4 window blocks.
- ``gemma3``: Gemma-3-like, 6 layers (5 sliding window of 48 tokens : 1 full): 6 groups of one
  layer; a chunk stores 3 of its 4 window blocks.
- ``gemma3pad``: the same layers x 17 (15 window : 2 full): vLLM pads the window layers to 16 and makes 8 window
  groups (one of a single layer) and 1 full group, as it does for Gemma-3-4B on the GPU.
- ``gemma2``: Gemma-2-like, 4 layers alternating sliding window (256 tokens: four 64-token chunks, as Gemma-2's
  4,096-token window is sixteen 256-token chunks) and full attention: 2 groups of equal block bytes.
- ``dsv2``: DeepSeek-V2-Lite-like MLA, 3 layers: one MLA group.
- ``mamba``: 4 layers alternating Mamba (mamba_cache_mode "align") and full attention.
"""
from __future__ import annotations

import json
import os

import torch

GPTOSS = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
    "hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 16, "num_hidden_layers": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
    "vocab_size": 1000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "sliding_window": 32,
    "layer_types": ["sliding_attention", "full_attention"] * 2, "rope_theta": 150000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 4096},
    "attention_bias": True, "swiglu_limit": 7.0, "hidden_act": "silu", "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "eos_token_id": 2, "pad_token_id": 0,
}
GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
    "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 32, "num_hidden_layers": 6, "vocab_size": 1000, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "sliding_window": 48, "sliding_window_pattern": 6, "query_pre_attn_scalar": 32,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "attn_logit_softcapping": None, "final_logit_softcapping": None, "hidden_activation": "gelu_pytorch_tanh",
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
#: Gemma-3-like with vLLM's padding: 17 layers (15 window : 2 full), so vLLM groups them by 2 and pads the
#: window layers with one layer: 8 window groups (one of 1 layer) + 1 full group, as Gemma-3-4B's 34 layers
#: (29 : 5) make 6 + 1 groups of 5 with one padding layer on the H200
GEMMA3_PADDED = dict(GEMMA3, num_hidden_layers=17,
                     layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 2 + ["sliding_attention"] * 5)
GEMMA2 = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
    "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "num_hidden_layers": 4, "vocab_size": 1000, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "sliding_window": 256, "query_pre_attn_scalar": 16,
    "layer_types": ["sliding_attention", "full_attention"] * 2, "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh", "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
DSV2 = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 3, "first_k_dense_replace": 1,
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_layer_freq": 1,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "topk_method": "greedy", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
    "norm_topk_prob": False, "vocab_size": 1000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False, "attention_bias": False,
}
LLAMA4 = {  # a plain Llama config: the Mamba hybrid's layer specs are written by hand below
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 1000,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "bos_token_id": 1,
    "eos_token_id": 2,
}
HF_CONFIGS = {"gptoss": GPTOSS, "gemma3": GEMMA3, "gemma3pad": GEMMA3_PADDED, "gemma2": GEMMA2, "dsv2": DSV2, "mamba": LLAMA4}
#: Mamba layers' state tensors (conv state, SSM state) of the ``mamba`` model
MAMBA_SHAPES = ((3, 32), (4, 16, 8))


def write_model_dir(path: str, name: str) -> str:
    """A model directory holding only ``config.json`` (no weights, no tokenizer)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(HF_CONFIGS[name], f)
    return path


def layer_specs(name: str, model_config, block_size: int, mamba_cache_mode: str = "align") -> dict:
    """Each layer's KV cache spec, as the layer would report it to vLLM."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec

    text = model_config.hf_text_config
    dtype = model_config.dtype
    layers = int(text.num_hidden_layers)
    specs: dict = {}
    if name == "dsv2":
        extra = {"max_tp_shards": 1} if "max_tp_shards" in MLAAttentionSpec.__dataclass_fields__ else {}
        for i in range(layers):
            specs[f"model.layers.{i}.self_attn.attn"] = MLAAttentionSpec(
                block_size=block_size, num_kv_heads=1, head_size=model_config.get_head_size(), dtype=dtype,
                cache_dtype_str="auto", **extra)
        return specs
    heads, head = model_config.get_total_num_kv_heads(), model_config.get_head_size()
    full = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head, dtype=dtype)
    if name == "mamba":
        mamba = MambaSpec(block_size=block_size, shapes=MAMBA_SHAPES, dtypes=(dtype, dtype),
                          page_size_padded=full.page_size_bytes, mamba_cache_mode=mamba_cache_mode)
        for i in range(layers):
            specs[f"model.layers.{i}.mixer" if i % 2 == 0 else f"model.layers.{i}.self_attn.attn"] = (
                mamba if i % 2 == 0 else full)
        return specs
    for i, kind in enumerate(text.layer_types):
        if kind == "sliding_attention":
            specs[f"model.layers.{i}.self_attn.attn"] = SlidingWindowSpec(
                block_size=block_size, num_kv_heads=heads, head_size=head, dtype=dtype,
                sliding_window=int(text.sliding_window))
        else:
            specs[f"model.layers.{i}.self_attn.attn"] = full
    return specs


def state_nbytes() -> int:
    """Bytes of one Mamba layer's state (bf16)."""
    n = 0
    for shape in MAMBA_SHAPES:
        size = 1
        for d in shape:
            size *= d
        n += size * torch.tensor([], dtype=torch.bfloat16).element_size()
    return n
