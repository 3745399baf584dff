"""Shared by tests/models: tiny HF checkpoints and transformers' own outputs as the oracle."""

import pytest
import torch


# Tiny shapes of real configs (Llama 3 8B in comments); initializer_range 0.2 instead of 0.02 makes
# the logits of a random 2-layer model spread out, so greedy decoding has no near-ties.
TINY_LLAMA = dict(
    vocab_size=128,  # 128256
    hidden_size=64,  # 4096
    intermediate_size=128,  # 14336
    num_hidden_layers=2,  # 32
    num_attention_heads=4,  # 32
    num_key_value_heads=2,  # 8
    head_dim=16,  # 128
    max_position_embeddings=256,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    initializer_range=0.2,
)
LLAMA3_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=64)
PROMPTS = [[3, 17, 91, 4, 55, 23, 8], [100, 2], [7, 7, 31, 64, 12, 90, 41, 33, 5, 19, 77, 120, 1], [42]]


def save_hf_llama(path, **overrides):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY_LLAMA, **overrides})
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def hf_greedy(model, prompts, max_new_tokens):
    """transformers' own greedy generate, one prompt at a time (no padding), never stopping at EOS."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=max_new_tokens,
                                 eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(ids))
            out.append(gen[0, len(p):].tolist())
    return out


def hf_last_logits(model, prompts):
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0, -1].float() for p in prompts]


TINY_GEMMA2 = dict(
    vocab_size=128,  # 256000
    hidden_size=64,  # 2304
    intermediate_size=128,  # 9216
    num_hidden_layers=2,  # 26
    num_attention_heads=4,  # 8
    num_key_value_heads=2,  # 4
    head_dim=16,  # 256
    max_position_embeddings=256,
    query_pre_attn_scalar=24,  # 256; not head_dim, so a scale taken from head_dim fails
    sliding_window=5,  # 4096; shorter than the prompts, so the window matters
    attn_logit_softcapping=2.0,  # 50; small, so the cap bends these logits
    final_logit_softcapping=3.0,  # 30
    initializer_range=0.2,
)


def save_hf_gemma2(path, **overrides):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Gemma2Config(**{**TINY_GEMMA2, **overrides})
    model = transformers.Gemma2ForCausalLM(config).eval()
    with torch.no_grad():  # HF initializes the (1 + w) norms at w = 0; make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(path)
    return model


def prefill_logits(llm, prompts):
    """The logits of each prompt's last token, from a one-token run (prompt order)."""
    caught = []
    llm.run(prompts, 1, lambda seqs, logits: caught.append((seqs, logits)) or [0] * len(seqs))
    out = {}
    for seqs, logits in caught:
        for s, row in zip(seqs, logits):
            out[s.index] = row
    return [out[i] for i in range(len(prompts))]
