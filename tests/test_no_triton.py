"""triton is optional on the CPU (kernels/loader.py): the demo and the API run with triton made unimportable and give
the tokens of a normal run without ever importing it; a Triton backend chosen without triton (CUDA, or a forced
KDTREE_*_BACKEND=triton) is one line naming the install, exit 2 from the CLI; any other import failure is not
mistaken for a missing triton.

Each case runs in a fresh interpreter whose first act puts a finder on sys.meta_path that refuses ``triton`` and
its submodules, as an environment without triton would (ModuleNotFoundError naming the module).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kdtree_engine.errors import BadInput
from kdtree_engine.exit_codes import BAD_INPUT_ERRORS
from kdtree_engine.kernels.loader import INSTALL_HINT, TritonMissing

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "def quicksort(items):"
GENERATE = ["generate", PROMPT, "--max-tokens", "4", "--json"]

BLOCK = '''
import sys

class NoTriton:
    def __init__(self, blocked):
        self.blocked = blocked

    def find_spec(self, name, path=None, target=None):
        if name == self.blocked or name.startswith(self.blocked + "."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoTriton(BLOCKED))
'''


def python(code: str, blocked: str | None = "triton", **env: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with ``blocked`` (and its submodules) unimportable (None: nothing)."""
    prelude = BLOCK.replace("BLOCKED", repr(blocked)) if blocked else ""
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


CLI = ("from kdtree_engine.cli import main\n"
       "rc = main({argv!r})\n"
       "print('triton imported:', 'triton' in sys.modules, file=sys.stderr)\n"
       "sys.exit(rc)\n")


def generate(blocked: str | None, **env: str) -> subprocess.CompletedProcess:
    return python("import sys\n" + CLI.format(argv=GENERATE), blocked, **env)


def test_demo_runs_without_triton_with_the_same_tokens() -> None:
    normal, without = generate(None), generate("triton")
    assert normal.returncode == 0, normal.stderr
    assert without.returncode == 0, without.stderr
    ids = json.loads(normal.stdout)["token_ids"]
    assert len(ids) == 4 and json.loads(without.stdout)["token_ids"] == ids
    # a CPU run does not import triton even where it is installed
    assert "triton imported: False" in normal.stderr and "triton imported: False" in without.stderr


def test_api_runs_without_triton() -> None:
    code = ("import kdtree_engine\n"
            "from kdtree_engine import LLM, SamplingParams\n"
            f"out = LLM().generate([{PROMPT!r}], SamplingParams(max_tokens=4))[0]\n"
            "import kdtree_engine.records as records\n"
            "mods = sorted(m for m in sys.modules if m == 'triton' or m.startswith('triton.'))\n"
            "print(len(out.token_ids), mods)\n")
    r = python("import sys\n" + code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[-2] == "4 []", r.stdout


def test_cuda_without_triton_is_one_line_naming_the_install() -> None:
    """A CUDA choice (the device object only: nothing runs on it) with triton missing: TritonMissing, bad input."""
    code = ("import torch\n"
            "from kdtree_engine.kernels import dispatch\n"
            "from kdtree_engine.kernels.policy import KernelPolicy\n"
            "assert dispatch.dense_backend(KernelPolicy(), torch.device('cpu')) == 'torch'\n"
            "for choose in (dispatch.dense_backend, dispatch.int4_backend, dispatch.attn_backend):\n"
            "    try:\n"
            "        choose(KernelPolicy(), torch.device('cuda'))\n"
            "    except Exception as e:\n"
            "        print(type(e).__name__, '|', e)\n")
    r = python(code)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 3, r.stdout
    for line in lines:
        kind, msg = line.split(" | ")
        assert kind == "TritonMissing" and "triton is not installed" in msg and INSTALL_HINT in msg, line
    assert issubclass(TritonMissing, BadInput) and issubclass(TritonMissing, BAD_INPUT_ERRORS)


def test_cli_with_a_triton_backend_and_no_triton_exits_2_in_one_line() -> None:
    """The CLI's path of the same error (a forced Triton backend on this CPU machine): one line, exit 2."""
    r = generate("triton", KDTREE_DENSE_BACKEND="triton")
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "loading weights" not in ln
             and not ln.startswith(("INFO ", "triton imported"))]
    assert len(lines) == 1 and lines[0].startswith("kdtree: error: triton is not installed"), r.stderr
    assert "pip install triton" in lines[0] and "Traceback" not in r.stderr


def test_other_import_failures_are_not_called_a_missing_triton() -> None:
    """triton present but one of its modules failing to import: the error propagates as it is."""
    code = ("import torch\n"
            "from kdtree_engine.kernels.loader import triton_kernels\n"
            "try:\n"
            "    triton_kernels()\n"
            "except Exception as e:\n"
            "    print(type(e).__name__, '|', e)\n")
    r = python(code, blocked="triton.language")
    assert r.returncode == 0, r.stderr
    kind, msg = r.stdout.strip().split(" | ")
    assert kind == "ImportError" and "language" in msg, r.stdout   # triton's own error, not TritonMissing
