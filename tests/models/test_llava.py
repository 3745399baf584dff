"""Llava 1.5 against transformers: prefill logits and 16 greedy tokens at levels 0-3, image features,
both checkpoint layouts, prompts with and without images in one batch, and the errors, named."""

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from dispatcher import compilation_counter
from models import LLM, CheckpointError, load_model
from models.llava import LlavaForConditionalGeneration, expand_image_tokens

from models_testing import TINY_LLAMA

transformers = pytest.importorskip("transformers")

TOLERANCES = {torch.float32: dict(rtol=1e-4, atol=1e-4)}  # measured: 5e-6 at levels 0 and 2

IMAGE = 159  # image_token_index: the last id of the vocab, as Llava 1.5's 32000 of 32064
P = 4  # image tokens per image: (28 / 14) ** 2 patches, CLS dropped  # 576
I = [IMAGE] * P

# Tiny shapes of Llava 1.5 7B: its text model is Llama's shape with 32064 ids (32 KV heads, 11008
# intermediate, rope_theta 10000 in the real one); initializer_range 0.2 (TINY_LLAMA) spreads the logits
# of a random 2-layer model, so greedy decoding has no near-ties.
TINY_TEXT = dict(TINY_LLAMA, vocab_size=160)
TINY_VISION = dict(
    hidden_size=32,  # 1024
    intermediate_size=64,  # 4096
    num_hidden_layers=2,  # 24
    num_attention_heads=4,  # 16
    image_size=28,  # 336
    patch_size=14,  # 14
    projection_dim=32,  # 768
)
# An image each, lengths 10, 6, 18, 7 (41 tokens: with max_num_tokens=32 some steps mix prefill and
# decode); the image at the start, the middle and the end.
PROMPTS = [[1, 5, *I, 17, 9, 33, 2], [*I, 2, 70], [7, 7, 31, 64, *I, 12, 90, 41, 33, 5, 19, 77, 120, 1, 8], [42, 8, 3, *I]]


def images(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 28, 28, generator=gen) for _ in range(n)]


def save_hf_llava(path, vision=None, **overrides):
    torch.manual_seed(0)
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**{**TINY_VISION, **(vision or {})}),
        text_config=transformers.LlamaConfig(**TINY_TEXT), image_token_index=IMAGE, image_seq_length=P, **overrides)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    model.save_pretrained(path)
    return model


def pixel_batch(imgs):
    return None if imgs is None else torch.stack(imgs if isinstance(imgs, list) else [imgs])


def hf_last_logits(model, prompts, imgs):
    with torch.no_grad():
        return [model(input_ids=torch.tensor([p]), pixel_values=pixel_batch(im)).logits[0, -1]
                for p, im in zip(prompts, imgs)]


def hf_greedy(model, prompts, imgs, max_new_tokens):
    """transformers' own greedy generate, one prompt at a time (no padding), never stopping at EOS."""
    out = []
    with torch.no_grad():
        for p, im in zip(prompts, imgs):
            ids = torch.tensor([p])
            pixels = {} if im is None else dict(pixel_values=pixel_batch(im))  # HF's generate fails on None
            gen = model.generate(ids, **pixels, max_new_tokens=max_new_tokens, do_sample=False,
                                 min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0,
                                 attention_mask=torch.ones_like(ids))
            out.append(gen[0, len(p):].tolist())
    return out


def prefill_logits(llm, prompts, imgs):
    caught = {}

    def choose(seqs, logits):
        caught.update((s.index, row) for s, row in zip(seqs, logits))
        return [0] * len(seqs)

    llm.run(prompts, 1, choose, images=imgs)
    return [caught[i] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def hf_llava(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llava")
    model = save_hf_llava(path)
    imgs = images(len(PROMPTS))
    return str(path), model, imgs, hf_last_logits(model, PROMPTS, imgs), hf_greedy(model, PROMPTS, imgs, 16)


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_parity_with_transformers(hf_llava, level):
    path, _, imgs, ref_logits, ref_tokens = hf_llava
    llm = LLM(path, level=level, max_num_tokens=32)
    assert isinstance(llm.model, LlavaForConditionalGeneration) and int(llm.level) == level
    for got, ref in zip(prefill_logits(llm, PROMPTS, imgs), ref_logits):
        torch.testing.assert_close(got, ref, **TOLERANCES[torch.float32])
    assert llm.generate(PROMPTS, max_new_tokens=16, images=imgs) == ref_tokens
    assert llm.stats.num_mixed_steps >= 1


@pytest.mark.cuda
@pytest.mark.parametrize("level", [0, 2, 3])
def test_cuda_matches_transformers(hf_llava, level, monkeypatch):
    """fp32 on the GPU (Triton decode kernel, custom ops, CUDA graphs at level 3) against transformers on CPU."""
    # The CLIP patch embedding is a convolution: cuDNN would run it in TF32 by default (1e-3 relative).
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    path, _, imgs, ref_logits, ref_tokens = hf_llava
    llm = LLM(path, level=level, max_num_tokens=32, device="cuda")
    for got, ref in zip(prefill_logits(llm, PROMPTS, imgs), ref_logits):
        torch.testing.assert_close(got.cpu(), ref, **TOLERANCES[torch.float32])
    assert llm.generate(PROMPTS, max_new_tokens=16, images=imgs) == ref_tokens


def test_image_prompts_are_prefilled_whole_while_text_is_chunked(hf_llava):
    """Budget 12: the 19-token image prompt is refused (its image features enter in one step); the same
    LLM chunks a 19-token text prompt and still matches a whole-prompt run."""
    path, _, imgs, _, _ = hf_llava
    llm = LLM(path, level=0, max_num_tokens=12)
    with pytest.raises(ValueError, match="more than max_num_tokens=12 \\(prompts with images are prefilled whole\\)"):
        llm.generate([PROMPTS[2]], images=[imgs[2]])
    text = [t if t != IMAGE else 3 for t in PROMPTS[2]]
    whole = LLM(path, level=0, max_num_tokens=32)
    assert llm.generate([text, PROMPTS[1]], 6, images=[None, imgs[1]]) == \
        whole.generate([text, PROMPTS[1]], 6, images=[None, imgs[1]])


def test_images_change_the_output(hf_llava):
    """The parity above is not the text-only model's: the images move the logits a lot."""
    path, hf, imgs, ref_logits, _ = hf_llava
    llm = LLM(path, level=0, max_num_tokens=32)
    text_only = prefill_logits(llm, PROMPTS, None)
    torch.testing.assert_close(text_only, hf_last_logits(hf, PROMPTS, [None] * len(PROMPTS)),
                               **TOLERANCES[torch.float32])
    assert min((a - b).abs().max().item() for a, b in zip(text_only, ref_logits)) > 1.0


def test_image_features_and_unused_layers(hf_llava):
    path, hf, imgs, _, _ = hf_llava
    model = load_model(path)
    # Feature layer -2 of 2: the last CLIP layer and post_layernorm are in the checkpoint but never built.
    assert len(model.vision_tower.encoder.layers) == 1
    assert not any("post_layernorm" in n for n, _ in model.named_parameters())
    pixels = torch.stack(imgs)
    with torch.no_grad():
        ref = torch.stack(list(hf.model.get_image_features(pixel_values=pixels).pooler_output))
        got = model.get_image_features(pixels)
    assert got.shape == ref.shape == (len(imgs), P, 64)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_full_strategy_and_several_feature_layers(tmp_path):
    """Not Llava 1.5's settings, but the config allows them: CLS kept (P + 1 tokens), two layers concatenated."""
    hf = save_hf_llava(tmp_path, vision=dict(num_hidden_layers=3), vision_feature_select_strategy="full",
                       vision_feature_layer=[-3, -1], projector_hidden_act="gelu_pytorch_tanh")
    llm = LLM(str(tmp_path), level=2, max_num_tokens=32)
    assert llm.model.config.num_image_tokens == P + 1 and len(llm.model.vision_tower.encoder.layers) == 3
    prompts = [[1, *I, IMAGE, 4], [9, 9, *I, IMAGE]]
    imgs = images(2, seed=3)
    for got, ref in zip(prefill_logits(llm, prompts, imgs), hf_last_logits(hf, prompts, imgs)):
        torch.testing.assert_close(got, ref, **TOLERANCES[torch.float32])
    assert llm.generate(prompts, 8, images=imgs) == hf_greedy(hf, prompts, imgs, 8)


def test_text_and_image_prompts_share_steps_with_one_trace(hf_llava):
    """Level 2: prompts without images, with one and with two, mixed in steps; the decoder is traced once
    (always with inputs_embeds), every step runs the captured code."""
    path, hf, imgs, _, _ = hf_llava
    two = images(2, seed=5)
    prompts = [PROMPTS[0], [3, 17, 91, 4, 55], [5, *I, 6, *I, 7], [IMAGE, 12, 13]]  # the last: an image token, no image
    imgs_or_none = [imgs[0], None, two, None]
    with compilation_counter.expect(num_graphs_seen=1, num_codes_captured=1, num_recompiles=0):
        llm = LLM(path, level=2, max_num_tokens=16)
        before = compilation_counter.num_dispatched_calls
        out = llm.generate(prompts, 16, images=imgs_or_none)
    assert compilation_counter.num_dispatched_calls - before == llm.stats.num_steps
    assert llm.stats.num_mixed_steps >= 1
    assert out == hf_greedy(hf, prompts, imgs_or_none, 16)


def rewrite_checkpoint(src, dst, rename):
    os.makedirs(dst)
    for f in os.listdir(src):
        if f.endswith(".json"):
            with open(os.path.join(src, f)) as a, open(os.path.join(dst, f), "w") as b:
                b.write(a.read())
    tensors = load_file(os.path.join(src, "model.safetensors"))
    save_file({rename(k): v for k, v in tensors.items()}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})
    return str(dst)


def hub_v4_name(k):  # llava-hf/llava-1.5-7b-hf: CLIPVisionModel nests its tower in vision_model
    return k.replace("vision_tower.", "vision_tower.vision_model.", 1)


def transformers_v5_name(k):
    for old, new in (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                     ("vision_tower.", "model.vision_tower.vision_model."),
                     ("multi_modal_projector.", "model.multi_modal_projector.")):
        if k.startswith(old):
            return new + k[len(old):]
    raise AssertionError(k)


def test_both_checkpoint_layouts_load_the_same(hf_llava, tmp_path):
    path = hf_llava[0]
    saved = load_file(os.path.join(path, "model.safetensors"))
    assert "language_model.model.embed_tokens.weight" in saved  # what this transformers writes
    ref = load_model(path)
    v4 = rewrite_checkpoint(path, tmp_path / "v4", hub_v4_name)
    v5 = rewrite_checkpoint(path, tmp_path / "v5", transformers_v5_name)
    for other in (load_model(v4), load_model(v5)):
        for (n, p), (_, q) in zip(ref.named_parameters(), other.named_parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)
    qkv = ref.vision_tower.encoder.layers[0].self_attn.qkv_proj
    torch.testing.assert_close(qkv.bias[32:64], saved["vision_tower.encoder.layers.0.self_attn.k_proj.bias"],
                               rtol=0, atol=0)


def test_checkpoint_errors_name_the_tensor(hf_llava, tmp_path):
    path = hf_llava[0]
    dropped = rewrite_checkpoint(path, tmp_path / "a", lambda k: k)
    tensors = load_file(os.path.join(dropped, "model.safetensors"))
    del tensors["multi_modal_projector.linear_1.weight"]
    tensors["multi_modal_projector.linear_3.weight"] = torch.zeros(2)
    tensors["vision_tower.embeddings.position_embedding.weight"] = torch.zeros(9, 32)
    save_file(tensors, os.path.join(dropped, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        load_model(dropped)
    msg = str(e.value)
    assert "missing tensor(s): multi_modal_projector.linear_1.weight" in msg
    assert "unexpected tensor(s): multi_modal_projector.linear_3.weight" in msg
    assert "vision_tower.embeddings.position_embedding.weight: expected shape [5, 32], checkpoint has [9, 32]" in msg


def test_config_errors(hf_llava):
    from models.llava import LlavaConfig

    hf = hf_llava[1].config.to_dict()
    with pytest.raises(ValueError, match="text_config.model_type: expected 'llama'.*'mistral'"):
        LlavaConfig.from_hf({**hf, "text_config": {**hf["text_config"], "model_type": "mistral"}})
    with pytest.raises(ValueError, match="vision_feature_select_strategy: .* got 'cls'"):
        LlavaConfig.from_hf({**hf, "vision_feature_select_strategy": "cls"})
    with pytest.raises(ValueError, match=r"image_token_index: expected a token id in \[0, vocab_size=160\); got 200"):
        LlavaConfig.from_hf({**hf, "image_token_index": 200})
    with pytest.raises(ValueError, match="vision_feature_layer: -4 is out of range for a vision tower of 2 layers"):
        LlavaForConditionalGeneration(LlavaConfig.from_hf({**hf, "vision_feature_layer": -4}))


def test_image_input_errors():
    llm = LLM("tiny-llava", level=0, max_num_tokens=32)
    img = images(1)[0]
    with pytest.raises(ValueError, match=r"prompt 0: image 0 has shape \[3, 32, 32\]; the vision tower takes "
                                         r"\[3, 28, 28\]"):
        llm.generate([[1, *I]], images=[torch.zeros(3, 32, 32)])
    with pytest.raises(ValueError, match=r"prompt 1: 2 image\(s\) need 8 image tokens \(id 159, 4 per image\); "
                                         r"the prompt has 4 in 1 run\(s\)"):
        llm.generate([[1, *I], [2, *I]], images=[img, [img, img]])
    with pytest.raises(ValueError, match="prompt 0: image-token run of 1 token.* at position 1; each image takes 4"):
        llm.generate([[1, IMAGE, 2, 3, *I[:3]]], images=[img])
    with pytest.raises(ValueError, match="image 0 has dtype torch.uint8"):
        llm.generate([[1, *I]], images=[torch.zeros(3, 28, 28, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="2 prompts, 1 entries"):
        llm.generate([[1, *I], [2]], images=[img])
    with pytest.raises(ValueError, match="prompt 0: images given, but LlamaForCausalLM takes no images"):
        LLM("tiny-llama", level=0, max_num_tokens=8).generate([[1, 2]], images=[img])


def test_tiny_llava_builtin_and_expand_image_tokens():
    a, b = load_model("tiny-llava"), load_model("tiny-llava")
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)  # random weights from a fixed seed
    assert expand_image_tokens([1, IMAGE, 2, *I, 3], IMAGE, P) == [1, *I, 2, *I, 3]
    llm = LLM("tiny-llava", level=2, max_num_tokens=32)
    prompt = expand_image_tokens([1, 2, IMAGE, 5], IMAGE, P)
    img = images(1)[0]
    with_image = llm.generate([prompt, prompt], 8, images=[img, None])
    assert all(len(o) == 8 for o in with_image)
    assert llm.generate([prompt], 8, images=[img]) == with_image[:1]  # alone as in a batch


# llava-hf/llava-1.5-7b-hf's config.json (transformers 4.36): HF saved only what differs from the defaults.
LLAVA_15_7B = {
    "architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100, "image_token_index": 32000,
    "model_type": "llava", "pad_token_id": 32001, "projector_hidden_act": "gelu", "tie_word_embeddings": False,
    "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures": ["LlamaForCausalLM"],
                    "max_position_embeddings": 4096, "model_type": "llama", "rms_norm_eps": 1e-05,
                    "torch_dtype": "float16", "vocab_size": 32064},
    "torch_dtype": "float16", "vision_config": {
        "hidden_size": 1024, "image_size": 336, "intermediate_size": 4096, "model_type": "clip_vision_model",
        "num_attention_heads": 16, "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768,
        "vocab_size": 32000},
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064,
}


def test_llava_15_7b_config_matches_transformers_tensor_for_tensor():
    """The real config, built on the meta device by both: every HF tensor maps to one of ours of the same shape,
    except the 24th CLIP layer and post_layernorm, which feature layer -2 never reads."""
    import re

    from models.loader import build_model, checkpoint_layout

    ours = build_model(LLAVA_15_7B, device="meta")
    assert ours.config.num_image_tokens == 576 and next(ours.parameters()).dtype == torch.float16
    with torch.device("meta"):
        hf = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(**LLAVA_15_7B))
    layout = checkpoint_layout(ours)
    ignored = [re.compile(p) for p in ours.ignored_checkpoint_names]
    skipped = set()
    for name, tensor in hf.state_dict().items():
        mapped = ours.canonical_checkpoint_name(name)
        if any(p.search(mapped) for p in ignored):
            skipped.add(re.sub(r"\.(weight|bias)$", "", mapped))
            continue
        assert layout.pop(mapped)[3] == tuple(tensor.shape), name
    assert not layout  # nothing of ours left without an HF tensor
    assert skipped == {"vision_tower.post_layernorm"} | {
        f"vision_tower.encoder.layers.23.{m}" for m in
        ("layer_norm1", "layer_norm2", "mlp.fc1", "mlp.fc2", "self_attn.q_proj", "self_attn.k_proj",
             "self_attn.v_proj", "self_attn.out_proj")}
