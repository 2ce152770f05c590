"""Model building blocks: tensor-parallel linears, embeddings, norms, activations, rotary, paged attention,
mixture-of-experts MLP."""
