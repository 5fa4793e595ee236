"""`LoopedLMConfig`: the Hugging Face config of an exported looped_lm checkpoint (model_type "looped_lm").

It carries the whole looped_lm run config (`looped_lm_config`), so the native model is rebuilt exactly,
plus the few top-level fields other tools read (vocab_size, hidden_size, heads, layers, positions).
"""

from __future__ import annotations

from transformers import PretrainedConfig


class LoopedLMConfig(PretrainedConfig):
    model_type = "looped_lm"

    def __init__(self, looped_lm_config: dict | None = None, kind: str = "gpt", vocab_size: int = 0,
                 model_state: dict | None = None, num_iterations: int | None = None, bridge: str | None = None,
                 tokenizer: str | None = None, hidden_size: int = 0, num_attention_heads: int = 0,
                 num_hidden_layers: int = 0, max_position_embeddings: int = 0, **kwargs):
        self.looped_lm_config = looped_lm_config or {}
        self.kind = kind  # gpt, db_ar or looped_db
        self.vocab_size = vocab_size
        self.model_state = model_state or {}  # what the native checkpoint saved (DB models: block edges)
        self.num_iterations = num_iterations  # DB models: the default K denoising steps per token
        self.bridge = bridge  # DB models: logits -> embedding rule between steps (hard / soft)
        self.tokenizer = tokenizer
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.num_hidden_layers = num_hidden_layers
        self.max_position_embeddings = max_position_embeddings
        kwargs.setdefault("tie_word_embeddings", True)  # the head is the embedding, transposed, stored once
        super().__init__(**kwargs)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // max(self.num_attention_heads, 1)
