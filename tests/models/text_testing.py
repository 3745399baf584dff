"""A real tokenizer beside tiny checkpoints, built in the test (no hub): a byte-level BPE trained on a few
sentences, saved with a tokenizer_config.json and a chat template; and a "chain" checkpoint whose greedy
next token is a fixed function of the last one, so a test can make the model write chosen tokens."""

import json
import os
import shutil

import pytest
import torch

from models_testing import save_hf_llama

CORPUS = ["The quick brown fox jumps over the lazy dog.", "hello world, hello there, hello again",
          "Café crème brûlée: naïve résumé!", "Stop here. Then go on; stop there."]
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: transformers' LlamaConfig bos_token_id=1, eos_token_id=2
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
VOCAB_SIZE = 320  # 3 special + 256 bytes + 61 merges  # 128256


def bytes_to_unicode():
    """GPT-2's byte -> printable character table, which the byte-level BPE's vocabulary is written in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def build_tokenizer(extra_special_tokens=()):
    """A transformers fast tokenizer: byte-level BPE of VOCAB_SIZE ids (+ ``extra_special_tokens`` after
    them), BOS added in front of each encoded text, EOS ``</s>``, the chat template above."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 10, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    assert tok.get_vocab_size() == VOCAB_SIZE
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", chat_template=CHAT_TEMPLATE,
                                                clean_up_tokenization_spaces=False)
    if extra_special_tokens:
        fast.add_special_tokens({"additional_special_tokens": list(extra_special_tokens)})
    return fast


def byte_token(tokenizer, b):
    """The id of the one-byte token of byte ``b`` (a piece of a multi-byte character when b >= 0x80)."""
    return tokenizer.convert_tokens_to_ids(bytes_to_unicode()[b])


def save_text_llama(path, tok=None, **overrides):
    """A tiny random Llama with the tokenizer beside it (``tok``, default :func:`build_tokenizer`'s);
    (transformers model, tokenizer)."""
    tok = tok or build_tokenizer()
    model = save_hf_llama(path, vocab_size=len(tok), bos_token_id=1, eos_token_id=2, **overrides)
    tok.save_pretrained(path)
    return model, tok


def save_chain_llama(path, chain, tok=None, **overrides):
    """A tiny Llama whose greedy next token after ``chain[i]`` is ``chain[i + 1]``, with the tokenizer.

    Attention and MLP outputs are zeroed, so the last hidden state is the normed embedding of the last
    token; ``lm_head`` row ``chain[i + 1]`` is ``chain[i]``'s embedding direction (logit ~ 80 against < 40
    for the other rows: random 64-dimensional directions). ``chain`` has no repeated token but the last.
    """
    model, tok = save_text_llama(path, tok, **overrides)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        head = model.lm_head.weight
        head.zero_()
        for a, b in zip(chain, chain[1:]):
            head[b] = 10 * emb[a] / emb[a].norm()
    model.save_pretrained(path)
    return model, tok


def with_files(src, dst, files):
    """A copy of checkpoint directory ``src`` at ``dst``, with ``files`` (name -> JSON object, or None to
    leave the file out) replaced."""
    shutil.copytree(src, dst)
    for name, content in files.items():
        file = os.path.join(dst, name)
        if content is None:
            os.remove(file)
        else:
            with open(file, "w") as f:
                json.dump(content, f)
    return str(dst)


# Tiny shapes of Llava 1.5 7B's vision tower (CLIP ViT-L/14 at 336 pixels): (28 / 14) ** 2 = 4 image tokens.
TINY_VISION = dict(hidden_size=32,  # 1024
                   intermediate_size=64,  # 4096
                   num_hidden_layers=2,  # 24
                   num_attention_heads=4,  # 16
                   image_size=28,  # 336
                   patch_size=14,  # 14
                   projection_dim=32)  # 768


def save_text_llava(path):
    """A tiny random Llava 1.5 with the tokenizer ("<image>" its last id, the image token) and a
    preprocessor_config.json (CLIP's, at 28 pixels); (transformers model, tokenizer, LlavaProcessor)."""
    transformers = pytest.importorskip("transformers")
    from models_testing import TINY_LLAMA

    tok = build_tokenizer(extra_special_tokens=("<image>",))
    image_token = tok.convert_tokens_to_ids("<image>")
    assert image_token == len(tok) - 1
    torch.manual_seed(0)
    text = transformers.LlamaConfig(**dict(TINY_LLAMA, vocab_size=len(tok), bos_token_id=1, eos_token_id=2))
    config = transformers.LlavaConfig(vision_config=transformers.CLIPVisionConfig(**TINY_VISION), text_config=text,
                                      image_token_index=image_token, image_seq_length=4)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    model.save_pretrained(path)
    images = transformers.CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    images.save_pretrained(path)
    tok.save_pretrained(path)
    processor = transformers.LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=14,
                                            vision_feature_select_strategy="default", num_additional_image_tokens=1)
    return model, tok, processor
