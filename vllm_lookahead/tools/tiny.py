"""A tiny random-weight Llama, written from scratch, for fast engine tests.

Use it with ``skip_tokenizer_init=True`` and token-id prompts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# Head sizes supported by vLLM's CPU attention backend (also fine on GPUs).
_SUPPORTED_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def make_tiny_model(
    path: str | os.PathLike[str],
    *,
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    seed: int = 0,
    max_position_embeddings: int = 2048,
) -> Path:
    """Write a random-weight ``LlamaForCausalLM`` folder (no tokenizer).

    The folder holds ``config.json`` (with ``rope_theta``),
    ``generation_config.json`` and float32 ``model.safetensors``; load it in
    vLLM with ``skip_tokenizer_init=True`` and token-id prompts. The weights
    depend only on the arguments (NumPy's PCG64 stream for ``seed``), so the
    same call always writes the same model.

    The init is deliberately "peaked": unit-variance embeddings and a
    scaled-up ``lm_head`` give logits with a standard deviation of about 4,
    so greedy decoding is decisive and varies with the context instead of
    collapsing onto one token. The ``lm_head`` row of the EOS token (id 2) is
    zero, so greedy decoding never stops early. ``bos_token_id`` is 1.

    Args:
        path: Output folder (created; existing files are overwritten).
        vocab_size: Vocabulary size (at least 3).
        hidden_size: Model width; ``hidden_size // num_heads`` must be a head
            size vLLM's attention supports (32, 64, ...).
        num_layers: Decoder layers.
        num_heads: Query heads.
        num_kv_heads: Key/value heads (must divide ``num_heads``).
        seed: Seed for the weights.
        max_position_embeddings: Context length written to the config.

    Returns:
        The output folder.
    """
    import numpy as np
    from safetensors.numpy import save_file

    if vocab_size < 3:
        raise ValueError(f"vocab_size must be >= 3, got {vocab_size}")
    if num_heads <= 0 or num_kv_heads <= 0 or num_layers <= 0:
        raise ValueError("num_heads, num_kv_heads and num_layers must be positive")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not a multiple of num_heads {num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    head_dim = hidden_size // num_heads
    if head_dim not in _SUPPORTED_HEAD_SIZES:
        raise ValueError(f"head_dim {head_dim} is not one of {_SUPPORTED_HEAD_SIZES}")

    bos_token_id, eos_token_id = 1, 2
    intermediate_size = 2 * hidden_size
    rng = np.random.default_rng(seed)

    def normal(shape: tuple[int, int], std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def linear(out_features: int, in_features: int) -> np.ndarray:
        return normal((out_features, in_features), 1.0 / np.sqrt(in_features))

    ones = np.ones(hidden_size, dtype=np.float32)
    tensors: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": normal((vocab_size, hidden_size), 1.0),
    }
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": ones.copy(),
            p + "self_attn.q_proj.weight": linear(num_heads * head_dim, hidden_size),
            p + "self_attn.k_proj.weight": linear(num_kv_heads * head_dim, hidden_size),
            p + "self_attn.v_proj.weight": linear(num_kv_heads * head_dim, hidden_size),
            p + "self_attn.o_proj.weight": linear(hidden_size, num_heads * head_dim),
            p + "post_attention_layernorm.weight": ones.copy(),
            p + "mlp.gate_proj.weight": linear(intermediate_size, hidden_size),
            p + "mlp.up_proj.weight": linear(intermediate_size, hidden_size),
            p + "mlp.down_proj.weight": linear(hidden_size, intermediate_size),
        }
    tensors["model.norm.weight"] = ones.copy()
    # After the final RMSNorm the hidden state has unit RMS, so this std
    # gives logits with a standard deviation of about 4.
    lm_head = normal((vocab_size, hidden_size), 4.0 / np.sqrt(hidden_size))
    lm_head[eos_token_id] = 0.0
    tensors["lm_head.weight"] = lm_head

    rope_theta = 10000.0
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "dtype": "float32",
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "mlp_bias": False,
        "num_attention_heads": num_heads,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": num_kv_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"},
        "rope_theta": rope_theta,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    generation_config = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id}

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name, content in (("config.json", config), ("generation_config.json", generation_config)):
        text = json.dumps(content, indent=2, sort_keys=True) + "\n"
        (out / name).write_text(text, encoding="utf-8")
    return out
