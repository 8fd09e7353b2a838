"""A word-level tokenizer of a small vocabulary, as a transformers fast tokenizer: the
shapes model's (``headscope.shapes``) and the tiny test models' (``headscope.hf.testing``)."""
from __future__ import annotations

from typing import Sequence


def word_level_tokenizer(tokens: Sequence[str], special: Sequence[str], eos: str,
                         **kwargs):
    """A ``PreTrainedTokenizerFast`` whose ids are the positions in ``tokens`` (which hold
    ``"<pad>"``, ``"<unk>"``, ``eos`` and every ``special`` token, never split): text
    splits on whitespace and punctuation; decoding joins words with spaces and none before
    punctuation ("top left."). ``kwargs`` go to the transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)},
                                         unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    backend.add_special_tokens(list(special))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                   pad_token="<pad>", eos_token=eos, **kwargs)
