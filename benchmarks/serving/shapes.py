"""Model shapes (``config.json`` only: vLLM fills dummy weights) and the model directory to serve.

The shapes follow the public configs of Llama-3-8B, Qwen2.5-7B, Qwen2.5-32B, Gemma-2-9B, Gemma-3-4B,
gpt-oss-20b and DeepSeek-V2-Lite in what sets the KV cache and the compute (layers, attention kinds and
windows, heads, KV heads, head size, hidden and MLP sizes, experts, vocabulary); every request sets
``ignore_eos``, as dummy weights emit EOS at random. The same dicts serve ``serve_bench.py``,
``vllm_ttft.py`` and ``envelope.py``.

Sliding-window hybrids (Gemma-2/3, gpt-oss) make several KV cache groups in vLLM, each taking its own
blocks from one pool: ``kv_groups`` names them and ``pool_blocks`` turns the history the GPU should hold
(``--gpu-blocks``, 16-token blocks of a sequence) into vLLM's ``--num-gpu-blocks-override``.

Threading: plain data and pure functions; no shared state.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile

_COMMON = {"hidden_act": "silu", "torch_dtype": "bfloat16", "tie_word_embeddings": False,
           "bos_token_id": 1, "eos_token_id": 2, "head_dim": 128}

SHAPES: dict[str, dict] = {
    "llama3-8b": {**_COMMON, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                  "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                  "num_hidden_layers": 32, "num_key_value_heads": 8, "max_position_embeddings": 16384,
                  "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "vocab_size": 128256,
                  "attention_bias": False, "mlp_bias": False},
    "qwen2.5-7b": {**_COMMON, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                   "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
                   "num_hidden_layers": 28, "num_key_value_heads": 4, "max_position_embeddings": 32768,
                   "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "vocab_size": 152064,
                   "use_sliding_window": False, "sliding_window": None, "max_window_layers": 28},
    "qwen2.5-32b": {**_COMMON, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                    "hidden_size": 5120, "intermediate_size": 27648, "num_attention_heads": 40,
                    "num_hidden_layers": 64, "num_key_value_heads": 8, "max_position_embeddings": 32768,
                    "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "vocab_size": 152064,
                    "use_sliding_window": False, "sliding_window": None, "max_window_layers": 64},
}

GEMMA3_4B = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
    "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "sliding_window": 1024, "sliding_window_pattern": 6,
    "layer_types": [("full_attention" if (i + 1) % 6 == 0 else "sliding_attention") for i in range(34)],
    "query_pre_attn_scalar": 256, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "max_position_embeddings": 131072, "vocab_size": 262208, "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": None, "final_logit_softcapping": None,
    "attention_bias": False, "torch_dtype": "bfloat16", "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
}
#: Gemma-2-9B's shape (issue 28's cliff): 42 layers alternating a 4,096-token window and full attention, 8 KV heads
#: of 256 (2 KV cache groups); max_position_embeddings raised from 8,192 so 12k-token prompts fit
GEMMA2_9B = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
    "hidden_size": 3584, "intermediate_size": 14336, "num_hidden_layers": 42,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "sliding_window": 4096,
    "layer_types": ["sliding_attention", "full_attention"] * 21, "query_pre_attn_scalar": 256,
    "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 16384, "vocab_size": 256000, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "attention_bias": False, "torch_dtype": "bfloat16", "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
}
GPTOSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
    "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
    "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4,
    "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "rope_theta": 150000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 4096},
    "max_position_embeddings": 131072, "vocab_size": 201088, "rms_norm_eps": 1e-5,
    "attention_bias": True, "swiglu_limit": 7.0, "hidden_act": "silu", "tie_word_embeddings": False,
    "initial_context_length": 4096, "torch_dtype": "bfloat16", "eos_token_id": 200002, "pad_token_id": 199999,
}
DSV2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
    "scoring_func": "softmax", "norm_topk_prob": False, "aux_loss_alpha": 0.001, "seq_aux": True,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "max_position_embeddings": 163840, "vocab_size": 102400, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 100000, "eos_token_id": 100001,
}
SHAPES.update({"gemma3": GEMMA3_4B, "gemma2": GEMMA2_9B, "gpt-oss": GPTOSS_20B, "dsv2-lite": DSV2_LITE})

#: default users per shape: 32B serves 96 so that two modes fit one device call (see docs/benchmarks.md)
DEFAULT_USERS = {"llama3-8b": 128, "qwen2.5-7b": 128, "qwen2.5-32b": 96, "gemma3": 128, "gpt-oss": 128,
                 "dsv2-lite": 128,
                 # Gemma-2: 336 KiB a token (its 4,096-token window spans every prompt here, so each layer keeps
                 # all of it): 96 users' history is 46 GiB, which a 58 GiB CPU tier of this host holds
                 "gemma2": 96}
#: default GPU KV cache (16-token blocks): 32 running users of the longest turn fit (86k tokens), and the
#: other users' history between two turns of a user exceeds it (32B: fewer users, so a smaller cache)
DEFAULT_GPU_BLOCKS = {"llama3-8b": 6912, "qwen2.5-7b": 6912, "qwen2.5-32b": 6144, "gemma3": 6912, "gpt-oss": 6912,
                      "dsv2-lite": 6912, "gemma2": 5760}


def kv_bytes_per_token(shape: str) -> int:
    """KV bytes of one token of ``shape`` over all layers (``kv_bytes_of``)."""
    return kv_bytes_of(SHAPES[shape])


def every_layer_bytes(shape: str, prefix: int | None) -> int | None:
    """Bytes of a ``prefix``-token conversation kept in every layer (``kv_bytes_per_token``): what vLLM's
    ``OffloadingConnector`` (0.26) stores when a prefill is one step (every block of every KV cache group, sliding
    windows included; read from its code, not measured). None for a shape or prefix not known."""
    return kv_bytes_per_token(shape) * prefix if shape in SHAPES and prefix else None


def kv_bytes_of(c: dict) -> int:
    """KV bytes of one token over all layers of the model config ``c``, bf16: K and V per KV head, or MLA's one
    latent per layer. For a sliding-window hybrid this is the bound a prefix within every window takes (a longer
    one keeps only the window in those layers)."""
    if "kv_lora_rank" in c:
        return c["num_hidden_layers"] * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 2
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head * 2


def kv_groups(shape: str) -> list[int | None]:
    """vLLM's KV cache groups of ``shape`` (``kv_groups_of``)."""
    return kv_groups_of(SHAPES[shape])


def kv_groups_of(c: dict) -> list[int | None]:
    """vLLM's KV cache groups of the model config ``c``, one entry each: None for full attention (and MLA), the
    window in tokens for a sliding-window group. vLLM puts the layers of each kind into groups of the smaller
    kind's layer count (Gemma-3's 5 full and 29 window layers: one full group, six window groups)."""
    types = c.get("layer_types") or ()
    full = sum(1 for t in types if t == "full_attention")
    window = len(types) - full
    if not types or not full or not window:
        return [None]
    size = min(full, window)
    return [None] * -(-full // size) + [c["sliding_window"]] * -(-window // size)


def pool_blocks(shape: str, history_blocks: int, running: int, max_seq: int, max_batched: int,
                block: int = 16) -> int:
    """vLLM's ``--num-gpu-blocks-override`` for a GPU cache that holds ``history_blocks`` blocks of sequence in
    each full-attention group. A window group whose window spans ``max_seq`` keeps every token as a full group
    does; a shorter window keeps, per running request, the window and one block, plus the blocks of one step's
    prefill (``max_batched`` tokens) before the ones outside the window are freed. One group: unchanged."""
    pool = 0
    for window in kv_groups(shape):
        if window is None or window >= max_seq:
            pool += history_blocks
        else:
            pool += running * (-(-window // block) + 1) + -(-max_batched // block)
    return pool


def weight_bytes(shape: str) -> int:
    """bf16 weight bytes (embeddings, attention, MLP or experts, LM head; norms ignored), for the dry run's
    sizes. MLA's projections are counted as attention of ``num_attention_heads`` heads (an estimate)."""
    c = SHAPES[shape]
    h, layers, v = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    head = c.get("head_dim") or h // c["num_attention_heads"]
    q = c["num_attention_heads"] * head
    kv = c["num_key_value_heads"] * head
    experts = c.get("num_local_experts") or c.get("n_routed_experts") or 0
    mlp = 3 * h * (c.get("moe_intermediate_size") or c["intermediate_size"]) * max(1, experts)
    per_layer = 2 * h * q + 2 * h * kv + mlp
    return 2 * (layers * per_layer + 2 * v * h)


def stable_model_dir(shape: str, root: str | None = None) -> str:
    """Where ``serve_bench.py`` writes ``shape``'s model directory: the same path for the same config on a machine.

    vLLM keys its torch.compile cache (``~/.cache/vllm/torch_compile_cache``) on the model path among others, so a
    fresh temporary directory per call made every call of a session compile again: on 2026-11-30 (H200, Gemma-2
    shape, ``--graphs compile``) three calls each spent 28.6-29.6 s in torch.compile, where a later start of the same
    call with the same settings loaded the compiled graph in 3.9 s. The name holds a digest of the config, so a
    changed shape never meets an old cache entry. The directory is left in place (a few KiB): runs on several GPUs
    of one host may share it, and with it vLLM's compile cache entry (vLLM's cache writes have raced between
    servers compiling one entry at once: vllm-project/vllm#24601; the serving runs meant for comparisons start
    one engine at a time)."""
    digest = hashlib.sha256(json.dumps(SHAPES[shape], sort_keys=True).encode()).hexdigest()[:12]
    return os.path.join(root or tempfile.gettempdir(), f"serve-bench-{shape}-{digest}")


def write_model_dir(shape: str, path: str, tokenizer: bool) -> str:
    """Write ``config.json`` (and, with ``tokenizer``, an offline word-level tokenizer) into ``path``; each file
    replaced whole (written aside, then renamed), so a server of another run reading the same directory never sees
    one half written."""
    os.makedirs(path, exist_ok=True)
    _replace_file(os.path.join(path, "config.json"), json.dumps(SHAPES[shape], indent=1))
    if tokenizer:
        write_wordlevel_tokenizer(path, SHAPES[shape]["vocab_size"])
    return path


def write_wordlevel_tokenizer(path: str, vocab_size: int) -> None:
    """A tokenizer that needs no download: token id i is the word ``t<i>``; decoding joins words by spaces.

    Used when the server must detokenize (``--tokenizer word``): prompts stay token ids either way.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # no "##" words here: plain space join
    _replace_file(os.path.join(path, "tokenizer.json"), tok.to_str())
    _replace_file(os.path.join(path, "tokenizer_config.json"),
                  json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20,
                              "bos_token": "t1", "eos_token": "t2", "unk_token": "t0",
                              "clean_up_tokenization_spaces": False}))


def _replace_file(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory and a rename."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600: another user's run on the host reads the same directory
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
