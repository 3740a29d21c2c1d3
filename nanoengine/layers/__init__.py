"""Model building blocks: RMSNorm, rotary embedding, SwiGLU, linear layers, sampler. Chapters 02 and 05."""
