"""A tiny DeepSeek-V2 checkpoint for the engine tests: random weights of a real scale, a word-level tokenizer
and a chat template, written offline in transformers' format (vLLM's own loader reads it).

2 layers, 4 heads, kv_lora_rank 512 + rope 64 (the latent width vLLM's MLA metadata and its CPU MLA kernel
take), vocabulary 512. Weights of std 0.1: vLLM's dummy weights (uniform +-1e-3, norms included) give near-zero
attention scores, so every backend would produce the same logits and a comparison could not fail.
The tokenizer maps the words ``w0`` ... ``w508`` and three special tokens onto the 512 ids, so every id the model
samples decodes, and prompts are plain text (``"w5 w17 w99"``).
"""
from __future__ import annotations

import json
from pathlib import Path

VOCAB = 512
NUM_LAYERS = 2
NUM_HEADS = 4
SPECIALS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant{% endif %}")


def words(ids) -> str:
    """The prompt text whose tokens are ``ids`` (each id >= 3)."""
    return " ".join(f"w{i - len(SPECIALS)}" for i in ids)


def write_checkpoint(path, *, kv_lora_rank: int = 512, max_positions: int = 256, seed: int = 1234) -> str:
    """Writes the model and its tokenizer under ``path``; returns ``str(path)``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    cfg = DeepseekV2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                           num_hidden_layers=NUM_LAYERS, num_attention_heads=NUM_HEADS,
                           num_key_value_heads=NUM_HEADS, n_shared_experts=1, n_routed_experts=4,
                           num_experts_per_tok=2, first_k_dense_replace=NUM_LAYERS, q_lora_rank=None,
                           kv_lora_rank=kv_lora_rank, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
                           max_position_embeddings=max_positions, rope_theta=10000.0, initializer_range=0.1,
                           tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    DeepseekV2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({f"w{i}": len(SPECIALS) + i for i in range(VOCAB - len(SPECIALS))})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    # the template also in tokenizer_config.json, where every transformers version looks for it
    cfg_file = path / "tokenizer_config.json"
    tc = json.loads(cfg_file.read_text())
    tc["chat_template"] = CHAT_TEMPLATE
    cfg_file.write_text(json.dumps(tc))
    return str(path)
