"""Published model shapes the GPU benches build with random weights (no download: throughput does not
depend on weight values)."""

LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
# The published configs' numbers (Hugging Face config.json of each model); tiny and smoke: toys of the same family
# for the benches' own tests.
SHAPES: dict[str, dict] = {
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                         rope_scaling={**LLAMA3_ROPE, "factor": 8.0}, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, tie_word_embeddings=False),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                         rope_scaling={**LLAMA3_ROPE, "factor": 32.0}, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, tie_word_embeddings=True),
    "tiny": dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True),
    "smoke": dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  tie_word_embeddings=True),
}
