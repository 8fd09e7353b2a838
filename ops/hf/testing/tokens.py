"""The ids of the tiny vocabulary's special tokens, which the tiny test models
(:mod:`headscope.hf.testing`), their saved checkpoints (``checkpoint.py``) and each family's
``TinySpec`` (``families/``) share. It imports nothing of theirs.
"""

# Token ids of the tiny vocabulary (random weights: only their roles matter). Ids 2.. are
# words (checkpoint.WORDS, then filler words); the top ids are special tokens: the shared
# roles below, then MARKER_IDS, which each family allocates to its own marker tokens in its
# TinySpec (the same id may serve different families, never two roles of one).
VOCAB = 512
IMAGE_TOKEN = 500
VIDEO_TOKEN = 501
VISION_START = 502
VISION_END = 503
EOS = 504
PAD = 0
MARKER_IDS = tuple(range(505, VOCAB))
