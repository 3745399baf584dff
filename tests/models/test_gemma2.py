"""Gemma 2 against transformers: soft-capping, sliding window, (1 + w) norms, scaled embeddings."""

import pytest
import torch

from models import LLM
from models.gemma2 import Gemma2ForCausalLM

from models_testing import PROMPTS, hf_greedy, hf_last_logits, prefill_logits, save_hf_gemma2


@pytest.fixture(scope="module")
def hf_gemma2(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_gemma2")
    hf = save_hf_gemma2(path)
    return str(path), hf_last_logits(hf, PROMPTS), hf_greedy(hf, PROMPTS, 16)


@pytest.mark.parametrize("level", [0, 2, 3])
def test_parity_with_transformers(hf_gemma2, level):
    path, ref_logits, ref_tokens = hf_gemma2
    llm = LLM(path, level=level, max_num_tokens=16)
    assert isinstance(llm.model, Gemma2ForCausalLM)
    assert [l.sliding_window for l in llm.layers.values()] == [5, None]
    for got, ref in zip(prefill_logits(llm, PROMPTS), ref_logits):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert llm.generate(PROMPTS, max_new_tokens=16) == ref_tokens
    assert llm.stats.num_mixed_steps >= 1


@pytest.mark.cuda
def test_cuda_tiny_gemma2_matches_cpu():
    cpu = LLM("tiny-gemma2", level=0, max_num_tokens=32)
    gpu = LLM("tiny-gemma2", level=2, max_num_tokens=32, device="cuda")
    prompts = PROMPTS + [[5] * 20]
    assert gpu.generate(prompts, 16) == cpu.generate(prompts, 16)
