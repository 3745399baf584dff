import pytest

from models_testing import LLAMA3_SCALING, save_hf_llama


@pytest.fixture(scope="session")
def hf_llama_dir(tmp_path_factory):
    """A tiny random Llama 3 checkpoint (GQA, llama3 RoPE scaling, untied) and the HF model it came from."""
    path = tmp_path_factory.mktemp("tiny_llama")
    model = save_hf_llama(path, rope_scaling=LLAMA3_SCALING)
    return str(path), model
