"""What a client moving from ``vllm serve`` expects of a request's deadline and of the model id (issue 23)."""
from __future__ import annotations

import pytest

from shared import protocol
from shared.errors import DeepinferError
from shared.model.locate import served_model_name


def test_requests_have_no_deadline_unless_the_client_sets_one():
    req = protocol.GenerateRequest(prompt="hi")
    assert req.timeout_s is None
    again = protocol.decode(protocol.encode(req), protocol.GenerateRequest)
    assert again.timeout_s is None
    assert protocol.GenerateRequest(prompt="hi", timeout_s=5).timeout_s == 5
    for bad in (0, -1, protocol.MAX_REQUEST_S + 1):
        with pytest.raises(DeepinferError):
            protocol.GenerateRequest(prompt="hi", timeout_s=bad)


@pytest.mark.parametrize("path, name", [
    (None, "SmolLM2-135M-Instruct"),
    ("/m/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
    ("/m/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "qwen2.5-coder-0.5b-instruct"),
    ("/m/Llama-3-8B.F16.gguf", "Llama-3-8B"),
    ("/m/plain.gguf", "plain"),
])
def test_served_model_name_is_the_model_files_clean_name(path, name):
    assert served_model_name(path) == name


def test_served_model_name_of_a_folder_is_its_name(tmp_path):
    folder = tmp_path / "my-finetune"
    folder.mkdir()
    assert served_model_name(folder) == "my-finetune"


def test_up_defaults_to_one_aggregated_worker_on_a_cpu_host_and_names_the_model():
    from cli import up as cli_up
    from cli.main import build_parser
    from services.router.config import RouterConfig
    from shared.config import load_config
    from cli.launcher import Cluster

    def spec(*flags: str):
        return cli_up.spec_from_args(build_parser().parse_args(["up", "--cache-tier", "0", *flags]), print)
    if cli_up.default_prefill_workers() == 0:  # fewer than 2 GPUs here
        assert spec().prefill == 0 and spec().decode == 1
    assert spec("--prefill", "1").prefill == 1
    named = spec("--served-model-name", "smollm", "--nats", "nats://127.0.0.1:1", "--no-auth")
    assert load_config(RouterConfig, Cluster(named).router_args()).served_model_name == "smollm"
