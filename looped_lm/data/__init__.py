"""Data: tokenizers, document sources, nanoGPT-format preparation and token-file reading."""

from looped_lm.data.bin_dataset import TokenStream, load_tokens
from looped_lm.data.prepare import DEFAULT_VAL_FRACTION, ensure_prepared, prepare_dataset
from looped_lm.data.sources import document_split, iter_documents, parse_hf_source
from looped_lm.data.tokenizer import EOT_TEXT, TOKENIZER_NAMES, Tokenizer, get_tokenizer

__all__ = [
    "DEFAULT_VAL_FRACTION",
    "EOT_TEXT",
    "TOKENIZER_NAMES",
    "TokenStream",
    "Tokenizer",
    "document_split",
    "ensure_prepared",
    "get_tokenizer",
    "iter_documents",
    "load_tokens",
    "parse_hf_source",
    "prepare_dataset",
]
