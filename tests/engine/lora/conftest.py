import pytest

from tests.peft_adapters import FIDELITY_ADAPTERS, make_adapters


@pytest.fixture(scope="session")
def adapter_dir(tmp_path_factory, hf_model):
    """Eight PEFT adapters on disk, and the PeftModel that holds them all (the oracle)."""
    d = tmp_path_factory.mktemp("adapters")
    oracle = make_adapters(hf_model, d, FIDELITY_ADAPTERS)
    return d, oracle
