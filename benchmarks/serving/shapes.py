"""Model shapes (``config.json`` only: vLLM fills dummy weights) and the model directory to serve.

The shapes follow the public configs of Llama-3-8B, Qwen2.5-7B and Qwen2.5-32B in what sets the
KV cache and the compute (layers, heads, KV heads, head size, hidden and MLP sizes, vocabulary);
token ids 1 and 2 are BOS/EOS in every shape (the offline tokenizer below names them so; every
request sets ``ignore_eos`` anyway, as dummy weights emit EOS at random).
"""
from __future__ import annotations

import json
import os

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

#: default users per shape: 32B serves 96 so that two modes fit one device call (see docs/benchmarks.md)
DEFAULT_USERS = {"llama3-8b": 128, "qwen2.5-7b": 128, "qwen2.5-32b": 96}
#: default GPU KV cache (16-token blocks): 32 running users of the longest turn fit (86k tokens), and the
#: other users' history between two turns of a user exceeds it (32B: fewer users, so a smaller cache)
DEFAULT_GPU_BLOCKS = {"llama3-8b": 6912, "qwen2.5-7b": 6912, "qwen2.5-32b": 6144}


def kv_bytes_per_token(shape: str) -> int:
    """K and V of one token over all layers, bf16."""
    c = SHAPES[shape]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * 2


def weight_bytes(shape: str) -> int:
    """bf16 weight bytes (embeddings, attention, MLP, LM head; norms ignored), for the dry run's sizes."""
    c = SHAPES[shape]
    h, i, layers, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i
    return 2 * (layers * per_layer + 2 * v * h)


def write_model_dir(shape: str, path: str, tokenizer: bool) -> str:
    """Write ``config.json`` (and, with ``tokenizer``, an offline word-level tokenizer) into ``path``."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(SHAPES[shape], f, indent=1)
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
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20,
                   "bos_token": "t1", "eos_token": "t2", "unk_token": "t0",
                   "clean_up_tokenization_spaces": False}, f)
