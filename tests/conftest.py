import os

import pytest
import torch

# Keep Dynamo's caches and Inductor's artifacts per test worker.
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _clean_dynamo_and_config(monkeypatch):
    """Each test starts from the environment's config and an empty Dynamo cache."""
    import dispatcher

    for var in list(os.environ):
        if var.startswith("DYNAMO_ONCE_") or var == "TORCH_COMPILE_DISABLE":
            monkeypatch.delenv(var, raising=False)
    dispatcher.set_compilation_config(None)
    torch._dynamo.reset()
    yield
    dispatcher.set_compilation_config(None)
    torch._dynamo.reset()
