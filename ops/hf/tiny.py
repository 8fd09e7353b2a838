"""What the tiny test models (:mod:`headscope.hf.testing`) and their saved checkpoints
(:mod:`headscope.hf.checkpoint`) share: the model types they cover and the ids of the tiny
vocabulary's special tokens. Both import it at module level; it imports nothing of theirs.
"""

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "llava", "idefics3",
            "smolvlm", "llava_next", "llava_onevision", "mistral3",
            "internvl", "glm4v", "glm4v_moe", "llama4", "gemma3",
            "paligemma")  # model types

# Token ids of the tiny vocabulary (random weights: only their roles matter).
VOCAB = 512
IMAGE_TOKEN = 500
VIDEO_TOKEN = 501
VISION_START = 502
VISION_END = 503
EOS = 504
PAD = 0
