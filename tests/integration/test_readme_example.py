"""The README's nats-py example runs as written against a live cluster (no deepinfer imports in it)."""
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.integration.services_harness import InProcessCluster
from tests.model_factory import write_tiny_hf_folder

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_example() -> str:
    text = README.read_text()
    block = re.search(r"<!-- nats-example.*?-->\s*```python\n(.*?)```", text, re.S)
    assert block, "README lost its NATS example"
    return block.group(1)


async def test_readme_nats_example_streams_an_answer(nats_server, tmp_path):
    folder = write_tiny_hf_folder(tmp_path / "tiny", seed=3)
    script = tmp_path / "example.py"
    script.write_text(readme_example())
    assert "import shared" not in script.read_text() and "services" not in script.read_text()
    async with InProcessCluster(nats_server.url, folder, local_prefill_threshold=0):
        import asyncio

        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(script), env={**os.environ, "NATS_URL": nats_server.url},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0, err.decode()
    assert "usage:" in out.decode() and "'completion_tokens': 8" in out.decode(), out.decode()


def readme_http_examples() -> tuple[str, str]:
    block = re.search(r"<!-- http-example.*?-->\s*```bash\n(.*?)```\s*```python\n(.*?)```", README.read_text(), re.S)
    assert block, "README lost its HTTP examples"
    return block.group(1), block.group(2)


async def test_readme_http_examples_answer(nats_server, tmp_path):
    import asyncio
    import json

    curl, python = readme_http_examples()
    folder = write_tiny_hf_folder(tmp_path / "tiny", seed=3)
    script = tmp_path / "openai_example.py"
    script.write_text(python)
    async with InProcessCluster(nats_server.url, folder, router_kw={"http_port": 0}) as cluster:
        env = {**os.environ, "DEEPINFER_HTTP": f"http://127.0.0.1:{cluster.router.http.port}"}
        shell = await asyncio.create_subprocess_exec("bash", "-c", curl, env=env, stdout=subprocess.PIPE,
                                                     stderr=subprocess.PIPE)
        curl_out, curl_err = await asyncio.wait_for(shell.communicate(), timeout=60)
        proc = await asyncio.create_subprocess_exec(sys.executable, str(script), env=env, stdout=subprocess.PIPE,
                                                    stderr=subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    answer = json.loads(curl_out)
    assert shell.returncode == 0 and answer["object"] == "chat.completion", (curl_out, curl_err)
    assert answer["usage"]["completion_tokens"] >= 1 and answer["choices"][0]["message"]["role"] == "assistant"
    assert proc.returncode == 0 and out.decode().endswith("\n"), err.decode()
