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
