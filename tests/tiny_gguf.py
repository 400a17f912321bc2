"""Write a tiny Llama model (tests' conftest) to a GGUF file with the ``gguf`` package, for llama.cpp tests.

The file holds the model's float32 weights and the byte-level tokenizer's
tokens (``gpt2`` tokenizer type), so llama.cpp computes the same logits as the
torch model up to float rounding. Query and key weights are permuted from
transformers' rotate-half layout to llama.cpp's interleaved rotary layout,
as llama.cpp's own converter does.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch


def _rotary_permute(weight: torch.Tensor, heads: int) -> np.ndarray:
    """[heads * d, in] rows from (half, pair) order to interleaved pairs."""
    out, rest = weight.shape[0], weight.shape[1:]
    return weight.reshape(heads, 2, out // heads // 2, *rest).swapaxes(1, 2).reshape(weight.shape).numpy()


def write_tiny_gguf(loaded, path: Path, tokens: list[str] | None = None, kind: str = "F32") -> Path:
    """Write ``loaded`` (a LoadedModel of a LlamaForCausalLM) to ``path``; ``tokens`` replaces the vocabulary's texts.

    ``kind``: the block format of the linear layers and the output layer
    (``F32``, or one the ``gguf`` package quantises: Q4_0, Q4_1, Q5_0, Q5_1,
    Q8_0); the embedding and the norms stay float32.
    """
    model, tokenizer = loaded.model, loaded.tokenizer
    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(loaded.max_context)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    texts = tokens or tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(texts)
    eos = tokenizer.eos_token_id
    writer.add_token_types([gguf.TokenType.CONTROL if i == eos else gguf.TokenType.NORMAL for i in range(len(texts))])
    writer.add_token_merges(["Ġ Ġ"])  # llama.cpp requires the key; ids are fed directly, nothing is tokenized
    writer.add_eos_token_id(eos)
    writer.add_bos_token_id(eos)
    writer.add_add_bos_token(False)

    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    def add(name: str, weight) -> None:
        weight = np.ascontiguousarray(weight)
        if kind == "F32":
            writer.add_tensor(name, weight)
            return
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, gguf.quants.quantize(weight, qtype), raw_dtype=qtype)

    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"].numpy())
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        writer.add_tensor(f"blk.{i}.attn_norm.weight", state[p + "input_layernorm.weight"].numpy())
        add(f"blk.{i}.attn_q.weight", _rotary_permute(state[p + "self_attn.q_proj.weight"], heads))
        add(f"blk.{i}.attn_k.weight", _rotary_permute(state[p + "self_attn.k_proj.weight"], kv_heads))
        add(f"blk.{i}.attn_v.weight", state[p + "self_attn.v_proj.weight"].numpy())
        add(f"blk.{i}.attn_output.weight", state[p + "self_attn.o_proj.weight"].numpy())
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", state[p + "post_attention_layernorm.weight"].numpy())
        add(f"blk.{i}.ffn_gate.weight", state[p + "mlp.gate_proj.weight"].numpy())
        add(f"blk.{i}.ffn_up.weight", state[p + "mlp.up_proj.weight"].numpy())
        add(f"blk.{i}.ffn_down.weight", state[p + "mlp.down_proj.weight"].numpy())
    writer.add_tensor("output_norm.weight", state["model.norm.weight"].numpy())
    add("output.weight", state["lm_head.weight"].numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
