"""config.json of the families that name their sizes their own way (Falcon, BLOOM, T5 / flan-t5), in the names
the size and footprint estimates read: hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
head_dim, intermediate_size, tie_word_embeddings, and `mlp_matrices` (2 for a plain MLP, 3 for a gated one, the
default). Other configs pass through unchanged."""
from __future__ import annotations


def common_names(config: dict) -> dict:
    """`config` with the common names set from its family's own."""
    model_type = config.get("model_type")
    hidden = config.get("hidden_size") or config.get("n_embed") or config.get("d_model")
    heads = config.get("num_attention_heads") or config.get("n_head") or config.get("num_heads")
    if model_type == "bloom":
        return {**config, "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": heads,
                "num_hidden_layers": config.get("num_hidden_layers") or config.get("n_layer"),
                "intermediate_size": 4 * int(hidden), "mlp_matrices": 2,
                "tie_word_embeddings": config.get("tie_word_embeddings", True)}
    if model_type == "falcon":
        if config.get("new_decoder_architecture"):
            kv_heads = config.get("num_kv_heads") or config.get("n_head_kv") or heads
        else:
            kv_heads = 1 if config.get("multi_query", True) else heads
        return {**config, "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
                "num_hidden_layers": config.get("num_hidden_layers") or config.get("n_layer"),
                "intermediate_size": config.get("ffn_hidden_size") or 4 * int(hidden), "mlp_matrices": 2,
                "tie_word_embeddings": config.get("tie_word_embeddings", True)}
    if config.get("is_encoder_decoder") and "d_model" in config:
        # T5: encoder and decoder layers both count; as KV layers, the encoder's stand in for the cross-attention
        layers = int(config.get("num_layers") or 0)
        return {**config, "hidden_size": hidden, "num_attention_heads": heads, "head_dim": config.get("d_kv"),
                "num_hidden_layers": layers + int(config.get("num_decoder_layers") or layers),
                "intermediate_size": config.get("d_ff"),
                "mlp_matrices": 3 if str(config.get("feed_forward_proj", "relu")).startswith("gated") else 2}
    return config
