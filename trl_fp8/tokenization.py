"""A character-level tokenizer that is built locally, with no download.

The embedded demo model uses it: every printable ASCII character (and newline) is one token, plus
``<pad>``, ``<eos>`` and ``<unk>``. It is a regular :class:`transformers.PreTrainedTokenizerFast`, so it
is saved with ``save_pretrained`` and loaded back with ``AutoTokenizer.from_pretrained`` like any other.
"""

from __future__ import annotations

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)
CHARACTERS = tuple(chr(c) for c in range(32, 127)) + ("\n",)

# A minimal chat template so conversational datasets also work with the demo tokenizer.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def char_vocab() -> dict[str, int]:
    """The token -> id map: special tokens first (pad=0, eos=1, unk=2), then the characters."""
    tokens = list(SPECIAL_TOKENS) + list(CHARACTERS)
    return {tok: i for i, tok in enumerate(tokens)}


def build_char_tokenizer(model_max_length: int = 256):
    """Build the character-level tokenizer (a ``PreTrainedTokenizerFast``) in memory."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    # BPE with no merges splits a string into single characters; Fuse joins them back without spaces.
    backend = Tokenizer(BPE(vocab=char_vocab(), merges=[], unk_token=UNK_TOKEN))
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=model_max_length,
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
