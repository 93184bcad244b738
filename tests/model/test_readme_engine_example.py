"""The README's engine-API example runs as written with the packaged SmolLM2 and prints what the README says."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_engine_example_prints_what_the_readme_says(tmp_path):
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- engine-example.*?-->\s*```python\n(.*?)```", text, re.S)
    assert block, "README lost its engine example"
    script = tmp_path / "engine_example.py"
    script.write_text(block.group(1))
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines == ["[7042, 30, 198, 198, 504, 3575, 282, 260] ' Paris.\\n\\nThe capital of the'",
                     "req-1 length cached tokens: 16"], proc.stdout
    assert all(line in text for line in ("`" + lines[0] + "`", "`" + lines[1] + "`"))
