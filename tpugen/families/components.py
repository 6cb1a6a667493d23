"""Configs of the text encoders and VAEs that several families' hub models share, for planning memory without
a download (each family's folder holds its own denoisers')."""

CLIP_L = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "vocab_size": 49408,
    "max_position_embeddings": 77,
    "projection_dim": 768,
}
CLIP_G = {
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "num_attention_heads": 20,
    "num_hidden_layers": 32,
    "vocab_size": 49408,
    "max_position_embeddings": 77,
    "projection_dim": 1280,
}
CLIP_H = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_attention_heads": 16,
    "num_hidden_layers": 23,
    "vocab_size": 49408,
    "max_position_embeddings": 77,
    "projection_dim": 512,
}
T5_XXL = {
    "d_model": 4096,
    "d_ff": 10240,
    "d_kv": 64,
    "num_heads": 64,
    "num_layers": 24,
    "vocab_size": 32128,
    "feed_forward_proj": "gated-gelu",
    "is_gated_act": True,
}
VAE_4 = {
    "block_out_channels": [128, 256, 512, 512],
    "latent_channels": 4,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "layers_per_block": 2,
}
VAE_16 = {**VAE_4, "latent_channels": 16, "use_quant_conv": False, "use_post_quant_conv": False}
