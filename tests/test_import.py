"""commsim must import without torch: planners install only simpy, pandas, matplotlib."""

import subprocess
import sys


def test_importing_commsim_does_not_import_torch():
    code = (
        "import sys, commsim, commsim.ir, commsim.models, commsim.cli\n"
        "import commsim.ir.trace\n"
        "assert 'torch' not in sys.modules, 'commsim imported torch'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_commsim_imports_with_torch_blocked():
    # An import hook that makes `import torch` fail, as on a machine without torch.
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ModuleNotFoundError('No module named torch')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import commsim, commsim.cli, commsim.models, commsim.ir\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
