"""Model building blocks: tensor-parallel linears, embeddings, norms, rotary, paged attention."""
